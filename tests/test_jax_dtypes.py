"""PyTensor's JAX mode as synkhronos compiles it (synkhronos/_integrations/jax_dtypes.py): every output
and update in the graph's dtype. JAX runs in a subprocess, on the CPU: this pytest
process forks workers in other tests, and JAX must not start before a fork."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import run_python

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="needs jax (a CPU build is enough)")

_SWEEP = """
    import warnings
    import numpy as np, pytensor, pytensor.tensor as pt
    from synkhronos._integrations.jax_dtypes import typed_jax_mode

    warnings.simplefilter("ignore")
    bad = []
    for dtype in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool"):
        x = pt.matrix("x", dtype=dtype)
        v = pytensor.shared(np.zeros(3, dtype=dtype), name="v")
        graph = {"mean": pt.mean(x, axis=0), "sum": pt.sum(x), "sum0": pt.sum(x, axis=0),
                 "prod": pt.prod(x, axis=0), "max": pt.max(x), "min": pt.min(x, axis=0),
                 "var": pt.var(x, axis=0), "tanh": pt.tanh(x), "x": x, "x+1.5": x + 1.5,
                 "dot": pt.dot(x, x.T), "cumsum": pt.cumsum(x, axis=0), "argmax": pt.argmax(x, axis=0),
                 "mean of a sum": pt.mean(pt.sum(x, axis=1) * 2)}
        if dtype == "bool":  # PyTensor types it bool; its Python kernel counts (int64)
            del graph["cumsum"]
        names = list(graph)
        update = [(v, pt.cast(v + pt.sum(x, axis=0), dtype))]
        data = (np.arange(12).reshape(4, 3) % 3 + 1).astype(dtype)
        plain = pytensor.function([x], [graph[k] for k in names], mode="FAST_COMPILE")
        typed = pytensor.function([x], [graph[k] for k in names], mode=typed_jax_mode("JAX"), updates=update)
        for name, want, got in zip(names, plain(data), typed(data)):
            want, got = np.asarray(want), np.asarray(got)
            if got.dtype != graph[name].type.dtype:  # (FAST_COMPILE's cumsum of int8 is int64)
                bad.append((dtype, name, str(graph[name].type.dtype), str(got.dtype)))
            elif not np.allclose(got.astype(float), want.astype(float), rtol=1e-2 if dtype == "float16" else 1e-6):
                bad.append((dtype, name, "values", got.tolist(), want.tolist()))
        if v.get_value(borrow=True).dtype != dtype:
            bad.append((dtype, "update", str(v.get_value(borrow=True).dtype)))
    print("BAD", bad)
"""


@pytest.mark.slow
def test_outputs_and_updates_have_the_graphs_dtypes():
    """Every dtype and a sample of ops (the reductions PyTensor accumulates in a wider
    dtype among them) give the graph's dtype and plain PyTensor's values; an update keeps
    its dtype. Slow (a JAX compile per dtype): make test keeps the float32 cases below."""
    done = run_python(_SWEEP, timeout=240, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "BAD []", done.stdout[-4000:]


def test_plain_jax_mode_differs_where_the_typed_one_does_not():
    """PyTensor's own JAX mode returns a float32 mean as float64 (what made float32 outputs
    float64 on the GPU device, issue 45): if it ever stops, jax_dtypes can go."""
    done = run_python("""
        import warnings
        import numpy as np, pytensor, pytensor.tensor as pt
        from synkhronos._integrations.jax_dtypes import typed_jax_mode
        warnings.simplefilter("ignore")
        x = pt.matrix("x", dtype="float32")
        for mode in ("JAX", typed_jax_mode("JAX")):
            print(pytensor.function([x], pt.mean(x ** 2, axis=0), mode=mode)(np.ones((2, 3), "float32")).dtype)
    """, timeout=120, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["float64", "float32"], done.stdout


def test_floatx_float32_names_the_outputs_jax_narrows():
    """With floatX=float32 PyTensor turns JAX's 64-bit types off: compiling a function with
    64-bit outputs warns, naming them; they come back in 32 bits, as PyTensor's own JAX mode
    gives them, and a float32 output stays float32."""
    done = run_python("""
        import warnings
        import numpy as np, pytensor, pytensor.tensor as pt
        from synkhronos._integrations.jax_dtypes import typed_jax_mode
        p, y = pt.matrix("p"), pt.lvector("y")
        acc = pt.mean(pt.eq(pt.argmax(p, axis=1), y))
        acc.name = "accuracy"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = pytensor.function([p, y], [acc, pt.sum(p, axis=0)], mode=typed_jax_mode("JAX"))
        ours = [str(w.message) for w in caught if "64-bit types disabled" in str(w.message)]
        print("WARNED", ours)
        print("DTYPES", [str(r.dtype) for r in f(np.ones((3, 2), "float32"), np.zeros(3, "int64"))])
    """, timeout=120, JAX_PLATFORMS="cpu", PYTENSOR_FLAGS="floatX=float32")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "come back in 32 bits: accuracy (float64); use floatX=float64" in done.stdout, done.stdout
    assert "DTYPES ['float32', 'float32']" in done.stdout, done.stdout
