"""A distributed function as a PyTensor Op (``Function.as_op``): value and gradient in one call."""

from __future__ import annotations

import itertools
import os
import sys
import warnings
import weakref

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type, grad_not_implemented
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op
from pytensor.scalar import upcast

from .. import _state as state

__all__ = ["SynkOp", "build_op", "register_jax", "register_numba"]

#: The live Ops of this process by token: a pickled Op (Numba's object mode pickles what
#: it calls) comes back as the same Op in this process, and as a clear error elsewhere.
_live_ops_cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENS = itertools.count()

#: Reduce ops under which the gradient of a reduced value is the reduced gradient.
LINEAR_OPS = ("sum", "avg")


def position(key, variables, what: str, fname: str) -> int:
    """The position of ``key`` (a variable, its name or an int) among ``variables``."""
    if isinstance(key, Variable):
        for i, v in enumerate(variables):
            if v is key:
                return i
        raise ValueError(f"{key} is not one of the {what}s of function {fname!r}")
    if isinstance(key, str):
        hits = [i for i, v in enumerate(variables) if v.name == key]
        if len(hits) != 1:
            names = [v.name for v in variables]
            raise ValueError(f"{what} name {key!r} names {len(hits)} of the {what}s of function "
                             f"{fname!r} ({names}); expected exactly one")
        return hits[0]
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        if not 0 <= key < len(variables):
            raise IndexError(f"{what} position {key} is out of range for the {len(variables)} {what}s "
                             f"of function {fname!r}")
        return int(key)
    raise TypeError(f"an {what} of function {fname!r} is named by its variable, its name or its "
                    f"position, got {key!r}")


def build_op(fn, inputs, outputs, bcast, fixed, grads) -> SynkOp:
    """Check ``grads`` (value output -> gradient outputs, one per free input) and build the Op."""
    free = [i for i in range(len(inputs)) if i not in fixed]
    parsed = {}
    if grads is not None and not isinstance(grads, dict):
        raise TypeError(f"grads must be a dict {{value output: [gradient output per free input]}}, "
                        f"got {grads!r}")
    for key, gouts in (grads or {}).items():
        j = position(key, outputs, "output", fn.name)
        var, mode = outputs[j], fn.output_modes[j]
        if var.type.ndim != 0:
            raise ValueError(f"grads: output {var.name or j!r} of function {fn.name!r} has ndim "
                             f"{var.type.ndim}; a gradient is declared for a scalar output only")
        if mode not in LINEAR_OPS:
            raise ValueError(f"grads: output {var.name or j!r} of function {fn.name!r} is reduced "
                             f"with {mode!r}; its gradient is the reduced gradient only for {LINEAR_OPS}")
        if not isinstance(gouts, (list, tuple)):
            gouts = [gouts]
        if len(gouts) != len(free):
            names = [inputs[i].name or f"#{i}" for i in free]
            raise ValueError(f"grads: output {var.name or j!r} needs one gradient output (or None) per "
                             f"free input {names}, got {len(gouts)}")
        row: list[int | None] = []
        for k, g in zip(free, gouts):
            if g is None:
                row.append(None)
                continue
            gj = position(g, outputs, "output", fn.name)
            gvar, inp = outputs[gj], inputs[k]
            label = f"grads: gradient output {gvar.name or gj!r} for input {inp.name or k!r}"
            if not bcast[k]:
                raise ValueError(f"{label}: the input is scattered; a gradient is declared for "
                                 "broadcast inputs (bcast_inputs) only")
            if fn.output_modes[gj] != mode:
                raise ValueError(f"{label} is reduced with {fn.output_modes[gj]!r}, its value "
                                 f"{var.name or j!r} with {mode!r}; expected the same op")
            if gvar.type.ndim != inp.type.ndim or gvar.type.dtype != inp.type.dtype:
                raise TypeError(f"{label} has dtype {gvar.type.dtype} and ndim {gvar.type.ndim}; "
                                f"expected the input's dtype {inp.type.dtype} and ndim {inp.type.ndim}")
            row.append(gj)
        parsed[j] = row
    return SynkOp(fn, inputs, outputs, fixed, parsed)


class SynkOp(Op):
    """A distributed :class:`synkhronos.Function` as a node of any PyTensor graph.

    Build it with :meth:`synkhronos.Function.as_op`. Its inputs are the
    function's inputs that were not given values (the *free* inputs), in the
    function's order; its outputs are all of the function's outputs, reduced
    as the function reduces them. Each evaluation is one distributed call.
    Where ``grads`` said which outputs hold the gradient of a scalar output,
    the Op's gradient reads them from the same call (no second call).
    """

    def __init__(self, fn, inputs, outputs, fixed, grads):
        self.fn = fn                # the Function (called through its public __call__)
        self.token = (os.getpid(), next(_TOKENS))
        _live_ops_cache[self.token] = self
        self.n_inputs = len(inputs)
        self.free = [i for i in range(len(inputs)) if i not in fixed]  # positions of the Op's inputs
        self.fixed = dict(fixed)    # position -> value (numpy array or synk.data)
        self.grads = dict(grads)    # value output -> [gradient output or None per free input]
        self.out_names = [var.name or f"#{j}" for j, var in enumerate(outputs)]
        self.in_types = [inputs[i].type for i in self.free]
        self.in_names = [inputs[i].name or f"#{i}" for i in self.free]
        self.out_types = []
        for var, mode in zip(outputs, fn.output_modes):
            shape = var.type.shape
            if isinstance(mode, str) and mode.endswith("gather") and shape:
                shape = (None,) + tuple(shape[1:])  # rows of every process
            self.out_types.append(pt.TensorType(var.type.dtype, shape=shape))

    def __str__(self) -> str:
        return f"SynkOp{{{self.fn.name}}}"

    def __reduce__(self):
        return _find_op, (self.token, str(self))

    def make_node(self, *inputs):
        if len(inputs) != len(self.free):
            raise TypeError(f"{self} takes {len(self.free)} inputs {self.in_names}, got {len(inputs)}")
        checked = [self._check_input(k, v) for k, v in enumerate(inputs)]
        if "pytensor.link.jax.dispatch" in sys.modules:
            register_jax()
        return Apply(self, checked, [t() for t in self.out_types])

    def _check_input(self, k: int, value) -> Variable:
        want = self.in_types[k]
        label = f"input {self.in_names[k]!r} of {self}"
        try:
            var = pt.as_tensor_variable(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{label} expects a tensor of dtype {want.dtype} and ndim {want.ndim}, "
                            f"got {value!r}: {err}") from None
        if var.type.ndim != want.ndim:
            raise TypeError(f"{label} expects ndim={want.ndim} (dtype {want.dtype}, shape {want.shape}), "
                            f"got {var} with ndim={var.type.ndim} (shape {var.type.shape})")
        if var.type.dtype != want.dtype:
            if upcast(want.dtype, var.type.dtype) != want.dtype:
                raise TypeError(f"{label} expects dtype {want.dtype}, got {var} of dtype {var.type.dtype}, "
                                "which would lose precision; cast it first")
            var = pt.cast(var, want.dtype)
        for axis, (w, g) in enumerate(zip(want.shape, var.type.shape)):
            if w is not None and g is not None and w != g:
                raise ValueError(f"{label} expects shape {want.shape}, got {var} of static shape "
                                 f"{var.type.shape} (axis {axis}: {g} != {w})")
        if var.type.shape != want.shape:
            var = pt.specify_shape(var, want.shape) if any(s is not None for s in want.shape) else var
        return var

    def perform(self, node, inputs, output_storage):
        if os.getpid() != self.token[0]:
            raise RuntimeError(_elsewhere(str(self), self.token[0]))
        values = dict(self.fixed)
        values.update(zip(self.free, inputs))
        out = self.fn(*[values[i] for i in range(self.n_inputs)])
        if len(output_storage) == 1 and not isinstance(out, list):
            out = [out]
        for store, value, typ in zip(output_storage, out, self.out_types):
            # a copy: a call may hand back memory the next call writes into
            store[0] = np.array(value, dtype=typ.dtype, copy=True)

    def L_op(self, inputs, outputs, output_grads):
        result = []
        for k, inp in enumerate(inputs):
            total = None
            for j, g in enumerate(output_grads):
                if isinstance(g.type, DisconnectedType):
                    continue
                grad_outs = self.grads.get(j)
                if grad_outs is None:
                    return [grad_not_implemented(
                        self, i, x, f"{self}: no gradient of its output {self.out_names[j]!r} was "
                        "declared; give as_op(grads={output: [one gradient output per free input]})")
                        for i, x in enumerate(inputs)]
                if grad_outs[k] is None:
                    continue
                term = g * outputs[grad_outs[k]]
                total = term if total is None else total + term
            result.append(disconnected_type() if total is None else pt.cast(total, inp.type.dtype))
        return result

    pullback = L_op  # PyTensor 3's name for it

    def connection_pattern(self, node):
        pattern = [[True] * len(node.outputs) for _ in node.inputs]
        for j in range(len(node.outputs)):
            for k in range(len(node.inputs)):
                grad_outs = self.grads.get(j)
                if grad_outs is not None and grad_outs[k] is None:
                    pattern[k][j] = False
        return pattern


def _find_op(key, label):
    op = _live_ops_cache.get(key)
    if op is None:
        raise RuntimeError(_elsewhere(label, key[0]))
    return op


def _elsewhere(label: str, pid: int) -> str:
    return (f"{label} runs in the process that made it (pid {pid}), not in pid {os.getpid()} (a "
            "process forked or spawned from it, such as a chain of pm.sample(cores=2)): it drives the "
            "workers of that process's fork. Run it there: pm.sample(cores=1), whose chains then run "
            "one after the other, each on every process of the fork, or nuts_sampler='numpyro' or "
            "'nutpie' with cores=1")


def register_jax() -> None:
    """Teach PyTensor's JAX backend the Op (imports JAX: only after fork()).

    Rendered as ``jax.pure_callback`` (one distributed call per evaluation)
    with a custom VJP whose forward pass takes the gradient outputs from the
    same call, so that ``jax.value_and_grad`` (numpyro, blackjax) costs one
    distributed call per step.
    """
    from pytensor.link.jax.dispatch import jax_funcify

    if SynkOp in jax_funcify.registry:
        return
    jax_funcify.register(SynkOp)(_jax_funcify_synk)


def register_numba() -> None:
    """Teach PyTensor's Numba backend the Op (nutpie's path) without the warning it gives for
    an Op run in Numba's object mode: that mode costs a few microseconds a call, and each call
    of this Op is a call of every process of the fork (tens of microseconds at least)."""
    from pytensor.link.numba.dispatch import basic

    if SynkOp in basic.numba_funcify.registry:
        return

    @basic.numba_funcify.register(SynkOp)
    def _numba_funcify_synk(op, node=None, storage_map=None, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
            return basic.generate_fallback_impl(op, node, storage_map, **kwargs)


def _jax_funcify_synk(op, node=None, **kwargs):
    import jax

    grad_of = {g: k for row in op.grads.values() for k, g in enumerate(row) if g is not None}
    for j, o in enumerate(node.outputs):
        if None in o.type.shape and j not in grad_of:
            raise NotImplementedError(
                f"{op}: output {op.out_names[j]!r} has no static shape ({o.type.shape}); JAX needs the "
                "shape of every output of a callback: give it one (pt.specify_shape) in the function")

    def call(*args):
        out = [[None] for _ in node.outputs]
        with state.inside_xla_callback():  # the master's share runs without JAX here
            op.perform(node, [np.asarray(a) for a in args], out)
        return tuple(o[0] for o in out)

    def result_shapes(args):
        # a gradient has its input's shape, which JAX knows while it traces
        return tuple(jax.ShapeDtypeStruct(args[grad_of[j]].shape if j in grad_of else o.type.shape,
                                          o.type.dtype) for j, o in enumerate(node.outputs))

    def forward(*args):
        return jax.pure_callback(call, result_shapes(args), *args, vmap_method="sequential")

    @jax.custom_vjp
    def synk(*args):
        return forward(*args)

    def fwd(*args):
        outs = forward(*args)
        return outs, (outs, args)

    def bwd(res, cotangents):
        outs, args = res
        grads: list = []  # numpy float0 zeros and JAX arrays
        for k, a in enumerate(args):
            if not jax.numpy.issubdtype(a.dtype, jax.numpy.inexact):  # data: no gradient
                grads.append(np.zeros(a.shape, dtype=jax.dtypes.float0))
                continue
            total = jax.numpy.zeros_like(a)
            for j, grad_outs in op.grads.items():
                if grad_outs[k] is not None:
                    total = total + cotangents[j] * outs[grad_outs[k]]
            grads.append(total)
        return tuple(grads)

    synk.defvjp(fwd, bwd)

    def synk_op(*args):
        outs = synk(*args)
        return outs if len(outs) > 1 else outs[0]

    return synk_op
