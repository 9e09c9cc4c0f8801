"""GPU scenarios, each run in a fresh Python process: ``python tests/gpu_scenarios.py NAME N [--fake]``.

A fresh process per scenario, because a process in which CUDA is up cannot
fork GPU workers. Each scenario forks N processes on the GPU device, checks
its results against ``as_pytensor`` on the same device, and prints ``OK``
and a JSON line of facts (device, whether NCCL was used, timings) at the end.

``--fake`` runs the same scenario without a GPU: the CuPy stand-in of
tests/fakegpu (whose NCCL has one rank per process, so NCCL is used with one
process only) and JAX's CPU device stand in for the GPU. It needs JAX (a CPU
build is enough). It proves the wiring, not CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OPS = ("avg", "sum", "prod", "max", "min", "gather", None)


def _install_fake() -> None:
    """CuPy stand-in and JAX on the CPU, as the GPU device of every process of the fork
    (tests/fakegpu/install.py, shared with bench/fakegpu_bench.py)."""
    from fakegpu.install import install

    install()


def _is_jax(x) -> bool:
    import jax

    return isinstance(x, jax.Array)


def _close(a, b, what, rtol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=what)


class _CountingNccl:
    """Stands in front of the master's NCCL communicator and counts the calls into it."""

    def __init__(self, comm):
        self._comm = comm
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(self._comm, name)
        if not callable(fn):
            return fn

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call


def _fork(n):
    import synkhronos as synk
    from synkhronos import gpu, _runtime as runtime

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert synk.fork(n, device="gpu") == n
    s = runtime.running_session()
    n_gpus = gpu.count_gpus()
    assert s.proc.device.name == "gpu" and s.proc.device.state is not None
    assert (s.proc.device.comm is not None) == (n <= n_gpus), (n, n_gpus, s.proc.device.comm)
    if n > n_gpus:
        assert any("share GPUs" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return s


def outputs(s, n: int) -> dict:
    """Every output op (and its c_ twin), nccl=False, device_outputs, uneven rows, updates."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos._batching import split

    rng = np.random.default_rng(0)
    x = pt.dmatrix("x")
    k = pt.lvector("k")
    w = pytensor.shared(rng.standard_normal((5, 3)), name="w")
    y = pt.dot(x, w)
    graph = [pt.mean(y, axis=0), pt.sum(y ** 2), pt.prod(pt.tanh(y) + 2, axis=0), pt.max(y, axis=0),
             pt.min(y), y, pt.sum(x)]
    outs = list(zip(graph, OPS))
    facts = {"n": n, "nccl": s.proc.device.comm is not None, "device": s.proc.device.state.describe()}
    f = synk.function([x], outs)
    f_c = synk.function([x], [(g, "c_" + op if op else None) for g, op in zip(graph, OPS)])
    f_off = synk.function([x], outs, nccl=False)
    f_int = synk.function([k], [(pt.sum(k), "sum"), (pt.mean(k), "avg"), (k, "gather"), (k.max(), "max")])
    assert f._spec.kwargs["mode"] == "JAX"
    counting = None
    if s.proc.device.comm is not None:
        counting = s.proc.device.comm._comm = _CountingNccl(s.proc.device.comm._comm)
    for rows in (7, 1, 2 * n + 1):  # uneven splits; fewer rows than processes
        data = rng.standard_normal((rows, 5))
        want = f.as_pytensor(data)
        for fn, label in ((f, "nccl"), (f_c, "c_"), (f_off, "nccl=False")):
            before = None if counting is None else len(counting.calls)
            got = fn(data)
            if counting is not None:
                went = counting.calls[before:]
                if fn is f:  # avg/sum/prod/max/min reduce to the master, gather all-gathers
                    assert went.count("reduce") == 5 and went.count("allGather") == 1, went
                else:
                    assert went == [], f"{label} went through NCCL: {went}"
            assert all(isinstance(g, np.ndarray) for g in got), [type(g) for g in got]
            for i, op in enumerate(OPS):
                if op is None:  # the master's own rows only
                    lo, hi = split(rows, n, s.proc.rank)
                    _close(got[i], np.sum(data[lo:hi]), f"{label} output {i} (None)")
                    continue
                _close(got[i], want[i], f"{label} output {i} ({op}), {rows} rows over {n}")
        for _ in range(2):  # the second call is planned (its plan serves both kinds of outputs)
            dev = f(data, device_outputs=True)
            assert all(_is_jax(g) for g in dev), [type(g) for g in dev]
            _close(dev[0], want[0], "device_outputs avg")
            _close(dev[1], want[1], "device_outputs sum")
        assert all(isinstance(g, np.ndarray) for g in f(data)), "numpy outputs after device outputs"
    ks = np.arange(11, dtype=np.int64)
    want = f_int.as_pytensor(ks)
    got = f_int(ks)
    assert got[0] == np.asarray(want[0]) and got[0].dtype == np.int64, (got[0], want[0])
    _close(got[1], want[1], "int avg")
    assert got[2].dtype == np.int64 and got[3] == 10
    np.testing.assert_array_equal(got[2], ks)
    # updates: each process applies its own, the value stays on the device
    v = pytensor.shared(np.zeros(3), name="v")
    g = synk.function([x], (pt.sum(x), "sum"), updates=[(v, v + pt.sum(x, axis=0)[:3])])
    g(np.ones((4, 5)))
    assert _is_jax(v.get_value(borrow=True)), type(v.get_value(borrow=True))
    g(np.ones((4, 5)), num_slices=2)
    assert _is_jax(v.get_value(borrow=True)), "a sliced update left the device"
    return facts


def shareds(s, n: int) -> dict:
    """Every collective on shared variables, their c_ twins, and residency on the device."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos import gpu

    a = pytensor.shared(np.zeros((4, 3)), name="a")
    b = pytensor.shared(np.zeros(5, dtype=np.int32), name="b")
    synk.function([], [pt.sum(a), pt.sum(b)])
    synk.distribute()
    both = [a, b]

    def resident(what):
        placed = gpu.on_device(both)
        assert all(np.all(p) for p in placed), f"after {what}: {placed}"

    resident("distribute")
    per = [np.arange(12.0).reshape(4, 3) * (r + 1) - r for r in range(n)]
    per_b = [np.arange(5, dtype=np.int32) * (r + 2) for r in range(n)]

    def reset():
        for r in range(n):
            synk.set_value(r, a, per[r])
            synk.set_value(r, b, per_b[r])
        resident("set_value")

    ref = {"avg": lambda p: np.mean(p, axis=0), "sum": lambda p: np.sum(p, axis=0),
           "prod": lambda p: np.prod(p, axis=0), "max": lambda p: np.max(p, axis=0),
           "min": lambda p: np.min(p, axis=0)}
    for prefix in ("", "c_"):
        for op, fn in ref.items():
            reset()
            got = synk.reduce(both, op=prefix + op, in_place=False)
            _close(got[0], fn(per), f"reduce {prefix}{op}")
            # an avg of integers is rounded into an integer variable, never truncated (as cast_to)
            _close(got[1], np.rint(fn(per_b)).astype(np.int32), f"reduce {prefix}{op} int32")
            synk.all_reduce(both, op=prefix + op)
            resident(f"all_reduce {prefix}{op}")
            for r in range(n):
                _close(synk.get_value(r, a), fn(per), f"all_reduce {prefix}{op} rank {r}")
                _close(synk.get_value(r, b), np.rint(fn(per_b)).astype(np.int32),
                       f"all_reduce {prefix}{op} b")
    reset()
    _close(synk.gather(a), np.stack(per), "gather nd_up=1")
    _close(synk.gather(a, nd_up=0), np.concatenate(per), "gather nd_up=0")
    reset()
    synk.reduce(a, op="sum")
    _close(a.get_value(), np.sum(per, axis=0), "reduce in place")
    resident("reduce in place")
    reset()
    synk.broadcast(a, np.full((2, 3), 7.0))
    resident("broadcast")
    for r in range(n):
        _close(synk.get_value(r, a), np.full((2, 3), 7.0), f"broadcast rank {r}")
    reset()
    got = synk.all_gather(a)
    _close(got, np.concatenate(per), "all_gather result")
    resident("all_gather")
    for r in range(n):
        _close(synk.get_value(r, a), np.concatenate(per), f"all_gather rank {r}")
    synk.scatter(a, np.arange(3.0 * 2 * n).reshape(2 * n, 3))
    resident("scatter")
    assert [tuple(s) for s in synk.get_shapes(a)] == [(2, 3)] * n
    # a function reads the device-resident values
    h = synk.function([], (pt.sum(a), "sum"))
    _close(h(), np.sum(np.arange(3.0 * 2 * n)), "function on scattered shared variable")
    resident("a call")
    return {"n": n, "nccl": s.proc.device.comm is not None}


#: The dtypes of the dtype sweep (every one NCCL and the CPU collectives move).
DTYPES = ("float32", "float64", "float16", "int32", "int64")
REDUCE_OPS = ("avg", "sum", "prod", "max", "min")


def _rtol(dtype) -> float:
    return {"float16": 5e-3, "float32": 1e-5}.get(np.dtype(dtype).name, 1e-12)


def _same(got, want, what) -> None:
    """``got`` has ``want``'s dtype and shape and its values (to the dtype's precision)."""
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=_rtol(want.dtype), atol=0, err_msg=what)


def _sweep_data(dtype, rows, cols, seed):
    """Values in [1, 2] (exact in every dtype, no overflow in a product of 7 rows)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 3, size=(rows, cols)).astype(dtype)
    return (1 + rng.integers(0, 5, size=(rows, cols)) / 4).astype(dtype)


def _output_sweep(s, n, dtype) -> None:
    """Every output op on every path in ``dtype``: the dtype and values of plain PyTensor
    on the whole batch (the avg of integers in float64), an update keeps its dtype."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos._batching import split
    from synkhronos.collectives.ops import result_dtype

    x = pt.matrix("x", dtype=dtype)
    v = pytensor.shared(np.zeros(3, dtype=dtype), name="v")
    graph = [getattr(pt, {"avg": "mean"}.get(op, op))(x, axis=0) for op in REDUCE_OPS] + [x * 2, x * 3]
    ops = REDUCE_OPS + ("gather", None)
    whole = pytensor.function([x], graph, mode="FAST_COMPILE")  # plain PyTensor, numpy's kernels
    update = [(v, pt.cast(v + pt.mean(x, axis=0), dtype))]  # a float32 mean is float32: no cast
    # each output twice in one function (one compilation): through the device's
    # communicator (NCCL where there is one) and through the CPU collectives (c_)
    both = list(zip(graph, ops)) + [(g, op and "c_" + op) for g, op in zip(graph, ops)]
    paths = {"nccl and c_": synk.function([x], both, updates=update)}
    if dtype == "float32":
        paths["nccl=False"] = synk.function([x], list(zip(graph, ops)), nccl=False)
    data = _sweep_data(dtype, 2 * n + 3, 3, seed=n)  # rows split unevenly
    lo, hi = split(len(data), n, s.proc.rank)
    want = [np.asarray(w) for w in whole(data)]
    want[-1] = np.asarray(whole(data[lo:hi])[-1])  # None: the master's own rows
    calls = [(label, fn, dict(device_outputs=d)) for label, fn in paths.items() for d in (False, True)]
    if dtype in ("float16", "float32"):  # slices accumulated on the host, in the output's dtype
        calls.append(("nccl and c_", paths["nccl and c_"], dict(num_slices=2)))
    for label, fn, kwargs in calls:
        got = fn(data, **kwargs)
        for i, op in enumerate(ops * (len(got) // len(ops))):
            exp = want[i % len(ops)]
            exp = exp.astype(result_dtype(exp.dtype, op) if op else exp.dtype)
            path = "c_" if i >= len(ops) else label.split()[0]
            _same(got[i], exp, f"{dtype} {path} {op} over {n} ({kwargs})")
    assert v.get_value(borrow=True).dtype == dtype, f"{dtype} update left {v.get_value(borrow=True).dtype}"
    for r in range(n):
        got = synk.get_value(r, v)
        assert got.dtype == dtype, f"{dtype} update in rank {r} left {got.dtype}"
    synk.all_reduce(v, "avg")  # refused the float64 an update had left in a float32 variable
    assert v.get_value(borrow=True).dtype == dtype, f"{dtype} all_reduce left {v.get_value(borrow=True).dtype}"


def _collective_sweep(s, n, dtype) -> None:
    """Every collective on a shared variable of ``dtype`` (the c_ twins too) keeps its dtype,
    in the master's result and in every process's value."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    a = pytensor.shared(np.zeros((4, 3), dtype=dtype), name=f"a_{dtype}")
    synk.function([], (pt.sum(a), "sum"))
    synk.distribute()
    per = [_sweep_data(dtype, 4, 3, seed=10 + r) for r in range(n)]
    ref = {"avg": np.mean, "sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}

    def reset():
        for r in range(n):
            synk.set_value(r, a, per[r])

    def everywhere(want, what):
        assert a.get_value(borrow=True).dtype == dtype, f"{what}: the master holds {a.get_value(borrow=True).dtype}"
        for r in range(n):
            _same(synk.get_value(r, a), want, f"{what}, rank {r}")

    for prefix in ("", "c_"):
        for op, fn in ref.items():
            exact = fn(np.stack(per).astype(np.float64), axis=0)  # an avg of integers rounds into them
            want = (np.rint(exact) if np.dtype(dtype).kind in "iu" else exact).astype(dtype)
            what = f"{dtype} {prefix}{op} over {n}"
            reset()
            _same(synk.reduce(a, op=prefix + op, in_place=False), want, f"reduce {what}")
            synk.all_reduce(a, op=prefix + op)
            everywhere(want, f"all_reduce {what}")
        reset()
        synk.reduce(a, op=prefix + "sum")
        _same(a.get_value(), np.sum(np.stack(per), axis=0).astype(dtype), f"reduce in place {dtype} {prefix}")
    reset()
    _same(synk.gather(a), np.stack(per), f"gather {dtype}")
    _same(synk.all_gather(a), np.concatenate(per), f"all_gather {dtype}")
    everywhere(np.concatenate(per), f"all_gather {dtype}")
    synk.broadcast(a, per[0][:2])
    everywhere(per[0][:2], f"broadcast {dtype}")
    rows = _sweep_data(dtype, 2 * n, 3, seed=99)
    synk.scatter(a, rows)
    for r in range(n):
        _same(synk.get_value(r, a), rows[2 * r:2 * r + 2], f"scatter {dtype} rank {r}")


def dtypes(s, n: int) -> dict:
    """Outputs and shared variables keep the graph's dtype on every path, for every op
    and dtype (issue 45: a float32 avg came back float64 on the GPU device)."""
    for dtype in DTYPES:
        _output_sweep(s, n, dtype)
        _collective_sweep(s, n, dtype)
    return {"n": n, "nccl": s.proc.device.comm is not None, "dtypes": list(DTYPES)}


#: The dtypes and shapes of the "planned" scenario.
PLANNED_DTYPES = ("float32", "float64", "int32", "int64", "uint8", "bool", "complex64")
PLANNED_SHAPES = ((), (1,), (7, 3))
#: The dtypes whose variables a function updates (v + 1) in "planned".
UPDATED = ("float32", "float64", "int32", "int64", "uint8")


def _planned_value(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu":
        return np.asarray(rng.integers(0 if dtype.kind == "u" else -50, 200 if dtype.kind == "u" else 50,
                                       size=shape)).astype(dtype)
    raw = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype.kind == "c" else 0)
    return np.asarray(raw).astype(dtype)


def _in_place_kind(dtype, op) -> bool:
    """NCCL reduces ``dtype`` by ``op`` in its own memory (see collectives/nccl.py)."""
    kind = np.dtype(dtype).kind
    return op in ("sum", "avg") if kind == "c" else not (kind in "iub" and op == "avg")


def _peek(x) -> np.ndarray:
    """A host copy of a device value that caches nothing in the JAX array
    (np.asarray would, on a GPU, and so turn off writing it in place)."""
    import cupy

    if _is_jax(x) and x.size:
        return cupy.from_dlpack(x).get()
    return np.array(x, copy=True)


class _Counted:
    """Counts the calls of module-level functions (monkeypatched by name)."""

    def __init__(self, where):
        self.n = 0
        for module, name in where:
            real = getattr(module, name)

            def counting(*a, _real=real, **k):
                self.n += 1
                return _real(*a, **k)

            setattr(module, name, counting)


def _planned_setup(rng):
    """The variables (one per dtype and shape, a twin of float32 (7, 3)), their
    functions and the numpy model."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    vs, model = {}, {}
    for dtype in PLANNED_DTYPES:
        for shape in PLANNED_SHAPES:
            name = f"{dtype}{shape}"
            model[name] = _planned_value(rng, dtype, shape)
            vs[name] = pytensor.shared(model[name].copy(), name=name)
    model["twin"] = _planned_value(rng, "float32", (7, 3))
    vs["twin"] = pytensor.shared(model["twin"].copy(), name="twin")
    ups = {}
    for dtype in UPDATED:
        group = [f"{dtype}{shape}" for shape in PLANNED_SHAPES]
        ups[dtype] = (group, synk.function([], pt.sum(vs[group[-1]]), updates=[
            (vs[g], pt.cast(vs[g] + 1, dtype)) for g in group]))
    readers = [vs[n] for n in vs if not n.startswith(UPDATED)]
    synk.function([], [pt.sum(pt.real(v)) if v.dtype.startswith("complex") else pt.sum(v) for v in readers])
    a, b = vs["float32(7, 3)"], vs["twin"]
    forward = synk.function([], pt.sum(a), updates=[(b, a)])  # JAX may hand b a's very array
    synk.distribute()
    return vs, model, ups, forward


def _planned_all_reduce(s, rng, vs, model, counts, facts) -> None:
    """One all_reduce of 1 to 3 random variables by a random op; with one process every
    op leaves the values as they were (an avg of integers rounds back into them).
    Where NCCL can write a value in place, it must: no conversion, one NCCL call
    per array, the very array kept; a value another variable holds is never written."""
    import synkhronos as synk
    from synkhronos._arrays import writable_in_place

    if facts.get("last") and rng.random() < 0.6:  # the same again: the kept plan's case
        op, names = facts["last"]
    else:
        op = REDUCE_OPS[rng.integers(len(REDUCE_OPS))]
        names = [n for n in vs if op in ("sum", "avg") or not vs[n].dtype.startswith("complex")]
        names = [str(x) for x in rng.choice(names, size=min(len(names), int(rng.integers(1, 4))), replace=False)]
        facts["last"] = (op, names)
    before = {n: vs[n].container.storage[0] for n in vs}
    ids = [id(v) for v in before.values()]
    twice = {n for n in names if ids.count(id(before[n])) > 1}
    direct = all(_in_place_kind(vs[n].dtype, op) and writable_in_place(before[n]) for n in names)
    direct = direct and not twice
    conv, calls = counts["conv"].n, len(counts["nccl"].calls)
    synk.all_reduce([vs[n] for n in names], op)
    after = {n: vs[n].container.storage[0] for n in vs}
    if direct:
        assert counts["conv"].n == conv, f"{op} of {names} converted arrays (to_cupy/to_jax)"
        assert counts["nccl"].calls[calls:] == ["allReduce"] * len(names), (op, names, counts["nccl"].calls[calls:])
        assert all(after[n] is before[n] for n in names), f"{op} of {names} did not write in place"
        facts["in_place"] += 1
    for n in twice:  # written elsewhere; the other holder keeps its array
        assert after[n] is not before[n], f"{n}: an array two variables hold was written in place"
        facts["held_twice"] += 1
    for n in vs:
        if n not in names:
            assert after[n] is before[n], f"{n} changed by an all_reduce of {names}"


def _async_host_copy_goes_stale(s):
    """A fact for the GPU report: after ``copy_to_host_async()`` (no ``_npy_value``
    yet, so the array still counts as writable in place), does ``np.asarray`` see a
    write into the device buffer? None when the array is not writable here."""
    import jax

    from synkhronos._arrays import cupy_at, device_pointer, writable_in_place

    x = jax.device_put(np.zeros(4, dtype=np.float32), s.proc.device.state.jax_device)
    x.copy_to_host_async()
    if not writable_in_place(x):
        return None
    view = cupy_at(device_pointer(x), np.float32, (4,), x)
    view[...] = 7  # (on the device, in CuPy's current stream)
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    return bool(np.asarray(x)[0] != 7)


def planned(n: int) -> dict:
    """A seeded random sequence on one process: all_reduce (every op; float32 to
    complex64, bool; 0-d, (1,), (7, 3)), calls with updates, set_value, get_value,
    np.asarray of borrowed values and a forwarding update (b := a), every value
    checked against a numpy model, bit for bit in dtype, shape and values, after
    every step. ``n`` picks the seed: the fork is always one process (the one
    the communicator's kept plan serves)."""
    import synkhronos as synk
    from synkhronos.collectives import nccl as nccl_module
    from synkhronos.devices import gpu as gpu_module

    from synkhronos._arrays import writable_in_place

    s = _fork(1)
    rng = np.random.default_rng(4800 + n)
    vs, model, ups, forward = _planned_setup(rng)
    counts = {"conv": _Counted([(nccl_module, "to_cupy"), (gpu_module, "to_jax")])}
    if s.proc.device.comm is not None:
        counts["nccl"] = s.proc.device.comm._comm = _CountingNccl(s.proc.device.comm._comm)
    kinds = ["all_reduce"] * 6 + ["call", "set_value", "get_value", "asarray", "forward", "alias"]
    facts = {k: 0 for k in kinds} | {"in_place": 0, "held_twice": 0, "plan_runs": 0, "host_copies": 0}
    plan_run = nccl_module._NcclPlan.run

    def counted_run(self, values, outs=None):
        done = plan_run(self, values, outs)
        facts["plan_runs"] += bool(done)
        return done

    nccl_module._NcclPlan.run = counted_run  # type: ignore[method-assign]
    for step in range(200):
        kind = kinds[rng.integers(len(kinds))]
        facts[kind] += 1
        name = list(vs)[rng.integers(len(vs))]
        if kind == "all_reduce" and "nccl" in counts:
            _planned_all_reduce(s, rng, vs, model, counts, facts)
        elif kind == "call":
            group, fn = ups[UPDATED[rng.integers(len(UPDATED))]]
            fn()
            for g in group:
                model[g] = (model[g] + 1).astype(model[g].dtype)
        elif kind == "set_value":
            model[name] = _planned_value(rng, model[name].dtype, model[name].shape)
            synk.set_value(0, vs[name], model[name].copy())
        elif kind == "get_value":
            _same(synk.get_value(0, vs[name]), model[name], f"step {step} get_value {name}")
        elif kind == "asarray":  # caches a host copy on a GPU: that value is then never written in place
            value = vs[name].get_value(borrow=True)
            _same(np.asarray(value), model[name], f"step {step} asarray {name}")
            if getattr(value, "_npy_value", None) is not None:
                assert not writable_in_place(value), f"{name}: a value with a host copy is writable"
                facts["host_copies"] += 1
        elif kind == "forward":
            forward()
            model["twin"] = model["float32(7, 3)"].copy()
        elif kind == "alias":  # as a forwarding JAX would leave them: one array, two variables
            vs["twin"].container.storage[0] = vs["float32(7, 3)"].container.storage[0]
            model["twin"] = model["float32(7, 3)"].copy()
        for m in vs:
            _same(_peek(vs[m].container.storage[0]), model[m], f"step {step} ({kind}) {m}")
    facts["async_host_copy_goes_stale"] = _async_host_copy_goes_stale(s)
    facts["plans"] = sum(type(p).__name__ == "_CommPlan" for p in s.kept.plans.values())
    facts.pop("last", None)
    assert facts["in_place"] > 0 and facts["plan_runs"] > 0, facts
    synk.close()
    return facts


#: The output ops, dtypes and per-row shapes of the "calls" scenario.
CALL_OPS = ("sum", "avg", "max", "min", "prod")
CALL_DTYPES = ("float32", "float64", "int32", "int64")
CALL_SHAPES = ((), (1,), (7, 3))


class _InPlaceReduces:
    """Stands in front of the master's NCCL communicator: counts its reduces, and
    those whose send buffer is the receive buffer (in place, on an output)."""

    def __init__(self, comm):
        self._comm = comm
        self.total = self.in_place = 0
        self.counts: list = []  # the element count of each reduce

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def reduce(self, send, recv, *args):
        self.total += 1
        self.in_place += send == recv
        self.counts.append(args[0])
        return self._comm.reduce(send, recv, *args)


def _call_model(data, op):
    if op == "sum":
        return data.sum(axis=0)
    if op == "avg":
        return data.mean(axis=0)
    if op == "prod":
        return data.prod(axis=0)
    return data.max(axis=0) if op == "max" else data.min(axis=0)


def _call_graph(x, op):
    import pytensor.tensor as pt

    if op == "sum":
        return pt.sum(x, axis=0)
    if op == "avg":
        return pt.mean(x, axis=0)
    if op == "prod":
        return pt.prod(x, axis=0)
    return pt.max(x, axis=0) if op == "max" else pt.min(x, axis=0)


def _same_call(got, want, what, dtype):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if np.dtype(dtype).kind == "f":
        assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, the graph's is {dtype}"
        np.testing.assert_allclose(got, want, rtol=_rtol(dtype), atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _random_calls(s, n, rng, facts) -> None:
    """Per dtype and row shape, one function of every op, called (planned from the second
    call) with numpy and with device outputs on seeded random rows: each output equals
    numpy's on all the rows; the inputs stay as they were."""
    import pytensor.tensor as pt

    import synkhronos as synk

    for dtype in CALL_DTYPES:
        for shape in CALL_SHAPES:
            x = pt.tensor(dtype=dtype, shape=(None,) + shape, name="x")
            f = synk.function([x], [(_call_graph(x, op), op) for op in CALL_OPS])
            for call in range(4):
                rows = int(rng.integers(1, 3 * n + 2))
                data = rng.integers(-3, 4, size=(rows,) + shape).astype(dtype)
                if np.dtype(dtype).kind == "f":
                    data += rng.standard_normal(data.shape).astype(dtype) / 4
                kept = data.copy()
                device = bool(call % 2)
                got = f(data, device_outputs=device)
                assert all(_is_jax(g) == device for g in got), (device, [type(g) for g in got])
                if not device:
                    assert all(g.flags.writeable for g in got), "a numpy output is read-only"
                for op, g in zip(CALL_OPS, got):
                    want = _call_model(data.astype(np.float64) if op == "avg" else data, op)
                    out_dtype = dtype if op != "avg" or np.dtype(dtype).kind == "f" else "float64"
                    _same_call(g, want.astype(out_dtype), f"{op} {dtype}{shape} {rows} rows, "
                               f"device_outputs={device}", out_dtype)
                np.testing.assert_array_equal(data, kept, err_msg="the call changed its input")
                facts["cases"] += 1


def _aligned(arr: np.ndarray) -> np.ndarray:
    """A copy of ``arr`` on a 64-byte boundary (JAX's DLPack then aliases it)."""
    buf = np.empty(arr.nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    out = buf[off:off + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


def _forwarding_calls(s, n, rng, facts, counting) -> None:
    """Outputs that are an input or a shared value, as a JAX that forwards inputs to
    outputs gives them (PyTensor copies such outputs; the master's share is made to
    forward here): reduced, and never written where they are. ``x`` (an input,
    aliased through DLPack), ``a`` (a shared variable), ``a`` after
    ``updates=[(b, a)]`` (two variables, one array), ``c``'s new value after
    ``updates=[(c, c + 1)]``, and one array as two outputs."""
    import jax
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos._function import worker as worker_module

    a0 = rng.standard_normal((7, 3)).astype(np.float32)
    a = pytensor.shared(a0.copy(), name="a")
    b = pytensor.shared(np.zeros((7, 3), np.float32), name="b")
    x = pt.tensor(dtype="float32", shape=(7, 3), name="x")
    fx = synk.function([x], (x * 1, "sum"), bcast_inputs=[x])
    fa = synk.function([], (a * 1, "sum"))
    fab = synk.function([], (a * 1, "sum"), updates=[(b, a)])
    c = pytensor.shared(np.zeros(3, np.float32), name="c")
    fc = synk.function([], (c + 1, "sum"), updates=[(c, c + 1)])
    y = pt.tensor(dtype="float32", shape=(None, 3), name="y")
    f2 = synk.function([y], [(pt.sum(y, axis=0), "sum"), (pt.sum(y, axis=0) * 1, "sum")])
    synk.distribute()
    for fn, args in ((fx, (a0,)), (fa, ()), (fab, ()), (fc, ()), (f2, (a0[:2 * n + 1, :],))):
        fn(*args)  # the full path, which plans the next calls (the master's share forwards in those)
    if counting is not None:
        counting.in_place = counting.total = 0
    a.set_value(a0.copy())
    real, forward = worker_module._run_kept, {"how": None}

    def forwarding(fn, args, trust):
        outs = list(real(fn, args, trust))
        how = forward["how"] if s.proc.is_master else None
        if how == "x":
            outs[0] = jax.dlpack.from_dlpack(args[0])
            facts["x_aliased"] += outs[0].unsafe_buffer_pointer() == args[0].ctypes.data
        elif how == "a":
            outs[0] = a.container.storage[0]
        elif how == "c":  # the output is the update's very array
            outs[0] = c.container.storage[0]
        elif how == "twice":
            outs[1] = outs[0]
        return outs

    worker_module._run_kept = forwarding
    try:
        for call in range(4):
            device = bool(call % 2)
            data = _aligned(rng.standard_normal((7, 3)).astype(np.float32))
            kept = data.copy()
            forward["how"] = "x"
            _same_call(fx(data, device_outputs=device), kept * n, f"x forwarded (call {call})", "float32")
            np.testing.assert_array_equal(data, kept, err_msg="a forwarded input was written")
            forward["how"] = "a"
            if call % 2:  # another array for a (the guard keeps the shared values' ranges by array)
                a.set_value(a0.copy())
            _same_call(fa(device_outputs=device), a0 * n, f"a forwarded (call {call})", "float32")
            _same_call(fab(device_outputs=device), a0 * n, f"a forwarded to b (call {call})", "float32")
            forward["how"] = "c"
            _same_call(fc(device_outputs=device), np.full(3, 2.0 + call, np.float32) * n,
                       f"an update's array as the output (call {call})", "float32")
            _same_call(c.get_value(), np.full(3, 2.0 + call, np.float32), f"c after call {call}", "float32")
            forward["how"] = "twice"
            rows = rng.standard_normal((2 * n + 1, 3)).astype(np.float32)
            for g in f2(rows, device_outputs=device):
                _same_call(g, rows.sum(axis=0), f"one array as two outputs (call {call})", "float32")
            forward["how"] = None
            for var, what in ((a, "a"), (b, "b")):
                _same_call(var.get_value(), a0, f"shared {what} after call {call}", "float32")
                _same_call(synk.get_value(0, var), a0, f"shared {what} in rank 0 after call {call}", "float32")
            facts["forwarded"] += 1
    finally:
        worker_module._run_kept = real


def _layout_changes(s, n, rng, facts, counting) -> None:
    """The kept output reduction of a planned call holds only for outputs of the layout it
    was made from: between planned calls with inputs of the same shapes, ``set_value``
    changes a shared value's shape (``x @ w`` gets another width), and an update grows
    one at every call (``v``, an output of its own); every output equals numpy's, and with
    NCCL (one process) each reduce has the element count of the output it reduces
    (never the kept plan's of another layout): the plan runs while the layout holds,
    refuses (nothing sent) when it changed, and is made again."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos.collectives import nccl as nccl_module

    w = pytensor.shared(rng.standard_normal((3, 4)).astype(np.float32), name="w")
    v = pytensor.shared(np.arange(2.0), name="v")
    x = pt.tensor(dtype="float32", shape=(None, 3), name="x")
    y = pt.dot(x, w)
    f = synk.function([x], [(pt.sum(y, axis=0), "sum"), (pt.max(y, axis=0), "max")])
    fv = synk.function([], (v * 2, "sum"), updates=[(v, pt.concatenate([v, v[-1:] + 1]))])
    synk.distribute()
    data = rng.standard_normal((2 * n + 1, 3)).astype(np.float32)
    real, runs = nccl_module._NcclReducePlan.run, {True: 0, False: 0}

    def counted(plan, values, outs=None):
        done = real(plan, values, outs)
        runs[done] += 1
        return done

    nccl_module._NcclReducePlan.run = counted
    try:
        for step, cols in enumerate((4, 4, 4, 4, 6, 6, 6, 2, 2, 5)):
            if w.get_value(borrow=True).shape[1] != cols:
                w.set_value(rng.standard_normal((3, cols)).astype(np.float32))
                if n > 1:
                    synk.broadcast(w)
            device = bool(step % 2)
            before = None if counting is None else len(counting.counts)
            got = f(data, device_outputs=device)
            want = data.astype(np.float64) @ w.get_value().astype(np.float64)
            _same_call(got[0], want.sum(axis=0).astype(np.float32), f"sum, {cols} columns", "float32")
            _same_call(got[1], want.max(axis=0).astype(np.float32), f"max, {cols} columns", "float32")
            if counting is not None:
                assert counting.counts[before:] == [cols, cols], (step, cols, counting.counts[before:])
                before = len(counting.counts)
            grown = fv(device_outputs=device)
            _same_call(grown, 2.0 * n * np.arange(2.0 + step), f"an update's growing value, step {step}", "float64")
            if counting is not None:
                assert counting.counts[before:] == [2 + step], (step, counting.counts[before:])
            facts["layouts"] += 1
    finally:
        nccl_module._NcclReducePlan.run = real
    facts["kept_runs"], facts["kept_refused"] = runs[True], runs[False]


def calls(n: int) -> dict:
    """Planned calls against numpy (:func:`_random_calls`) and outputs JAX forwards
    (:func:`_forwarding_calls`); with NCCL (one process on the stand-in), counted:
    the ordinary outputs are reduced in place, forwarded ones never."""
    import synkhronos as synk

    s = _fork(n)
    rng = np.random.default_rng(4900 + n)
    facts = {"n": n, "nccl": s.proc.device.comm is not None, "cases": 0, "forwarded": 0, "x_aliased": 0,
             "layouts": 0}
    counting = None
    if s.proc.device.comm is not None:
        counting = s.proc.device.comm._comm = _InPlaceReduces(s.proc.device.comm._comm)
    _random_calls(s, n, rng, facts)
    if counting is not None:
        facts["in_place"], facts["reduces"] = counting.in_place, counting.total
        counting.in_place = counting.total = 0
    _forwarding_calls(s, n, rng, facts, counting)
    if counting is not None:
        facts["forwarded_in_place"], facts["forwarded_reduces"] = counting.in_place, counting.total
        assert facts["x_aliased"] == 4 and counting.total == 24, facts  # every planned call forwarded
    _layout_changes(s, n, rng, facts, counting)
    synk.close()
    return facts


#: The scenarios that share one fork in "contract": the public contract on the GPU device.
CONTRACT = {"outputs": outputs, "shareds": shareds, "dtypes": dtypes}


def _in_a_fork(body):
    """``body(s, n)`` in a fork of its own."""
    def run(n: int) -> dict:
        import synkhronos as synk

        facts = body(_fork(n), n)
        synk.close()
        return facts

    return run


def contract(n: int) -> dict:
    """outputs, shareds and dtypes in one fork: the GPU's start (CUDA and JAX in every
    process, seconds each) once for the three."""
    import synkhronos as synk

    s = _fork(n)
    facts = {"n": n, "nccl": s.proc.device.comm is not None}
    facts.update((name, body(s, n)) for name, body in CONTRACT.items())
    synk.close()
    return facts


def refork(n: int) -> dict:
    """close() and fork() again in one process: allowed with one process on the same GPU."""
    import synkhronos as synk

    _fork(1)
    synk.close()
    _fork(1)
    synk.close()
    if n > 1:
        try:
            _fork(n)
        except RuntimeError as err:
            assert "JAX was already used in this process" in str(err), err
        else:
            raise AssertionError("forking GPU workers after CUDA was up should fail")
    return {"n": n}


def jax_cpu(n: int) -> dict:
    """The CPU device with functions in PyTensor's JAX mode: outputs are JAX arrays in
    every process and go through the CPU collectives; results equal as_pytensor."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos import _runtime as runtime
    from synkhronos._batching import split

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        synk.fork(n, device="cpu")
    assert runtime.running_session().proc.device.name == "cpu"
    rng = np.random.default_rng(1)
    x = pt.dmatrix("x")
    w = pytensor.shared(rng.standard_normal((5, 3)), name="w")
    y = pt.dot(x, w)
    graph = [pt.mean(y, axis=0), pt.sum(y ** 2), pt.prod(pt.tanh(y) + 2, axis=0), pt.max(y, axis=0),
             pt.min(y), y, pt.sum(x)]
    f = synk.function([x], list(zip(graph, OPS)), mode="JAX",
                      updates=[(w, w * 0.5)])
    for rows in (7, 1, 2 * n + 1):
        data = rng.standard_normal((rows, 5))
        raw = f.as_pytensor(data)
        kinds = sorted({type(v).__name__ for v in raw})
        want = [np.asarray(v) for v in raw]
        w.set_value(w.get_value() * 2)  # undo the master's update from as_pytensor
        synk.broadcast(w)
        got = f(data)
        for i, op in enumerate(OPS):
            if op is None:
                lo, hi = split(rows, n, 0)
                _close(got[i], np.sum(data[lo:hi]), "None output")
            else:
                _close(got[i], want[i], f"JAX mode on CPU, output {i} ({op}), {rows} rows over {n}")
        for r in range(min(rows, n)):  # a process with no rows computes nothing, updates nothing
            _close(synk.get_value(r, w), synk.get_value(0, w), f"update in rank {r}")
    synk.all_reduce(w, "avg")
    got = synk.gather(w)
    assert got.shape == (n, 5, 3)
    synk.close()
    return {"n": n, "as_pytensor output types": kinds}


def _gpu_apps() -> dict:
    """pid -> MiB of GPU memory used, from nvidia-smi (empty where it is missing)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    apps = {}
    for line in out.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            apps[int(pid)] = int(mib.strip() or 0)
    return apps


def _gpu_memory_mib() -> tuple:
    """(used, total) MiB of GPU 0, from nvidia-smi."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    used, total = out.splitlines()[0].split(",")
    return int(used), int(total)


def killed(n: int) -> dict:
    """JAX's memory per process on a shared GPU, then a worker SIGKILLed while calls run:
    WorkerDiedError in the master within seconds, close() leaves nothing in /dev/shm,
    and the workers' GPU memory is freed."""
    import signal
    import threading
    import time

    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos import _runtime as runtime

    n = max(n, 2)  # a worker to kill
    s = _fork(n)
    pids = dict(runtime.running_session().watch.pids)
    rng = np.random.default_rng(0)
    # on a GPU, work enough to show JAX's memory; on the stand-in (numpy on shared CPU
    # cores) a call of that size took seconds, and the master noticed the death only after it
    width, rows = (128, 256) if getattr(sys.modules.get("cupy"), "FAKE", False) else (1024, 2048)
    x = pt.matrix("x", dtype="float32")
    w = pytensor.shared((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), name="w")
    y = x
    for _ in range(16):
        y = pt.tanh(pt.dot(y, w))
    f = synk.function([x], (pt.sum(y), "sum"))
    data = rng.standard_normal((rows * n, width)).astype(np.float32)
    _close(f(data), f.as_pytensor(data), "the call before the kill", rtol=1e-3)
    apps = _gpu_apps()
    ours = {r: apps.get(p) for r, p in pids.items()}
    ours[s.proc.rank] = apps.get(os.getpid())
    facts = {"n": n, "gpu_mib_per_rank": ours}
    if apps:  # together the processes must not take most of the card (JAX preallocates 75% unless told not to)
        facts["gpu_used_mib"], facts["gpu_total_mib"] = used, total = _gpu_memory_mib()
        assert used < total / 2, facts
    victim = max(pids)
    calls = [0]
    killer = threading.Timer(0.5, os.kill, (pids[victim], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 30:
            f(data)
            calls[0] += 1
    except synk.WorkerDiedError as err:
        facts["error"] = str(err)[:200]
        assert err.rank == victim, (err.rank, victim)
    else:
        raise AssertionError("no WorkerDiedError within 30 s of the kill")
    finally:
        killer.cancel()
    facts["noticed_after_s"] = round(time.monotonic() - t0 - 0.5, 3)
    facts["calls_before"] = calls[0]
    assert facts["noticed_after_s"] < 10, facts
    synk.close()
    tag = f"synk.{os.getpid()}."
    left = [e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag)]
    assert not left, f"left in /dev/shm: {left}"
    if apps:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            still = set(_gpu_apps()) & set(pids.values())
            if not still:
                break
            time.sleep(0.2)
        assert not still, f"workers still hold GPU memory after close(): {still}"
    return facts


SCENARIOS = {**{name: _in_a_fork(body) for name, body in CONTRACT.items()}, "contract": contract,
             "refork": refork, "jax_cpu": jax_cpu, "killed": killed, "planned": planned,
             "calls": calls}


def main(argv) -> int:
    name, n = argv[0], int(argv[1])
    if "--fake" in argv:
        _install_fake()
    facts = SCENARIOS[name](n)
    print("OK")
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
