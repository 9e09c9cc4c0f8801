"""PyTensor's JAX mode with the graph's dtypes: each node's result cast to its output's type.

PyTensor's JAX rendering does not always give a node's result the dtype its
output has in the graph. With PyTensor 3.0.7 (JAX 0.10 on the CPU here, 0.11 on
an H200 in issue 45's run), a ``Sum``, ``Prod`` or ``mean`` of float32 is rendered as
``jnp.sum(x).astype(acc_dtype)``, and PyTensor accumulates float32 in float64,
so the result is float64 where the graph says float32 (float16 sums come back
float32); whatever reads it computes in float64 too, and an update stores a
float64 value in a float32 shared variable, which ``set_value`` and every
collective then refuse. The Numba backend (the CPU device's default) gives float32.

:func:`typed_jax_mode` gives a JAX mode whose linker casts each node's result
to its output's dtype inside the traced function (XLA fuses the conversion;
nothing happens where the dtypes agree), so a JAX-mode function computes in
the graph's dtypes as the other backends do. One exception, PyTensor's own:
with ``floatX="float32"`` PyTensor turns JAX's 64-bit types off, and JAX
then computes float64 and int64 as float32 and int32; compiling a function
with such outputs warns, naming them (use ``floatX="float64"``, PyTensor's
default, for 64-bit results). Any other difference raises a ``TypeError``
naming the output at the first call, never returns another dtype.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

__all__ = ["typed_jax_mode"]


def typed_jax_mode(mode):
    """``mode`` (a name or a ``Mode`` whose linker is PyTensor's JAX linker) with the
    linker of this module: the same rewrites, results in the graph's dtypes."""
    from pytensor.compile.mode import Mode, get_mode

    mode = get_mode(mode)
    if isinstance(mode.linker, _linker_class()):
        return mode
    return Mode(linker=_linker_class()(), optimizer=mode.provided_optimizer, db=mode.optdb)


def _wanted(var):
    """The dtype JAX can give graph variable ``var`` (64-bit types become 32-bit where
    JAX has them disabled), or None for a type without a dtype (random generators)."""
    import jax

    dtype = getattr(var.type, "dtype", None)
    try:
        return None if dtype is None else np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    except TypeError:
        return None


def _cast(value, dtype):
    """``value`` as ``dtype``; numpy values stay numpy (static for JAX's tracing), values
    without a dtype (Python numbers of shapes) stay as they are."""
    if dtype is None or getattr(value, "dtype", dtype) == dtype:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value).astype(dtype)
    return value.astype(dtype)


def _typed_conversion(op, node=None, **kwargs):
    """``jax_funcify`` of one node, its results cast to the node's output dtypes."""
    from pytensor.link.jax.dispatch import jax_funcify

    fn = jax_funcify(op, node=node, **kwargs)
    if node is None:
        return fn
    wanted = [_wanted(out) for out in node.outputs]
    if all(w is None for w in wanted):
        return fn
    if len(wanted) == 1:
        (dtype,) = wanted
        return functools.wraps(fn)(lambda *args: _cast(fn(*args), dtype))

    def typed(*args):
        return tuple(_cast(v, w) for v, w in zip(fn(*args), wanted))

    return functools.wraps(fn)(typed)


def _name(var) -> str:
    return str(var.name or var)


def _warn_narrowed(fgraph) -> None:
    narrowed = [f"{_name(out)} ({out.type.dtype})" for out in fgraph.outputs
                if _wanted(out) is not None and _wanted(out) != np.dtype(out.type.dtype)]
    if narrowed:
        warnings.warn(f"JAX has 64-bit types disabled in this process (PyTensor disables them when floatX is "
                      f"float32), so these outputs come back in 32 bits: {', '.join(narrowed)}; use "
                      "floatX=float64 for 64-bit results in mode='JAX'", UserWarning, stacklevel=2)


def _check_outputs(fgraph, fn):
    """``fn`` (the converted graph), refusing at trace time an output whose dtype is not the graph's."""
    wanted = [_wanted(out) for out in fgraph.outputs]
    names = [_name(out) for out in fgraph.outputs]

    def checked(*args):
        outs = fn(*args)
        for value, dtype, name in zip(outs, wanted, names):
            got = getattr(value, "dtype", None)
            if dtype is not None and got is not None and got != dtype:
                raise TypeError(f"JAX computes output {name} as {got}, but the graph says {dtype}")
        return outs

    return functools.wraps(fn)(checked)


@functools.cache
def _linker_class():
    """The linker class, made on first use: PyTensor's JAX linker is imported only then."""
    from pytensor.link.jax.dispatch import jax_typify
    from pytensor.link.jax.linker import JAXLinker
    from pytensor.link.utils import fgraph_to_python

    class TypedJAXLinker(JAXLinker):
        """PyTensor's JAX linker, each node's result in its output's dtype."""

        # JAXLinker's own signature, which already differs from JITLinker's
        def fgraph_convert(self, fgraph, input_storage, storage_map, **kwargs):  # type: ignore[override]
            # the parent's conversion replaces shared random generators and finds the inputs
            # used as static shapes; its function is then rendered again, node by node, typed
            super().fgraph_convert(fgraph, input_storage=input_storage, storage_map=storage_map, **kwargs)
            fn = fgraph_to_python(fgraph, _typed_conversion, type_conversion_fn=jax_typify,
                                  fgraph_name="jax_funcified_fgraph", input_storage=input_storage,
                                  storage_map=storage_map, **kwargs)
            _warn_narrowed(fgraph)
            return _check_outputs(fgraph, fn)

    return TypedJAXLinker
