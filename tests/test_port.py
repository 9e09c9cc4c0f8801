"""A port from the original Synkhronos is rename-only (issue 17).

Every keyword of the original's API, with real workers; a script written in
the original's style that runs unchanged; and the scenarios of the original's
five demos, each on 1, 2 and 3 processes.
"""

from __future__ import annotations

import glob
import os
import pstats
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_allclose, assert_array_equal

try:
    from pytensor import wrap_py
except ImportError:  # older PyTensor (2.30) names it as_op
    from pytensor.compile.ops import as_op as wrap_py

import synkhronos as synk
from conftest import MODE, shm_names, worker_pids
from synkhronos import _state as state, gpu, _runtime as runtime
from synkhronos._shareds import api as shareds

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------
# fork(): the original's keywords


def test_fork_use_gpu_false_is_the_cpu_device():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 2 processes fit the cores of any test machine
        assert synk.fork(2, use_gpu=False, master_rank=1, max_n_var=10, max_dim=3) == 2
    assert runtime.running_session().proc.device.name == "cpu" and runtime.running_session().proc.rank == 1
    synk.close()
    # the original's positional form: fork(n_parallel, use_gpu, master_rank)
    assert synk.fork(2, False, 0) == 2
    assert runtime.running_session().proc.device.name == "cpu"


@pytest.mark.skipif(gpu.get_n_gpu() > 0, reason="a GPU is present: use_gpu=True uses it")
def test_fork_use_gpu_true_without_a_gpu_warns_and_uses_the_cpu():
    with pytest.warns(UserWarning, match=r"use_gpu=True, but .*(could not be|no GPU).*running on "
                                         r"the CPU \(device='gpu' makes this an error\)"):
        assert synk.fork(2, use_gpu=True) == 2
    assert runtime.running_session().proc.device.name == "cpu"
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    assert f(np.arange(5.0)) == 10.0


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(use_gpu="yes"), TypeError, "use_gpu must be True, False or None, got 'yes'"),
    (dict(use_gpu=False, device="gpu"), ValueError, "use_gpu=False contradicts device='gpu'"),
    (dict(use_gpu=True, device="cpu"), ValueError, "use_gpu=True contradicts device='cpu'"),
    (dict(device=True, use_gpu=True), TypeError, "use_gpu given twice"),
    (dict(max_n_var=0), TypeError, r"max_n_var must be a positive int or None \(it is ignored\), got 0"),
    (dict(max_dim=2.5), TypeError, "max_dim must be a positive int or None .*got 2.5"),
    (dict(profile_workers="/no/such/dir"), ValueError,
     "profile_workers='/no/such/dir' is not an existing directory"),
    (dict(profile_workers=3), TypeError, "profile_workers must be True, False or a directory path, got 3"),
])
def test_bad_original_fork_keywords(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        synk.fork(2, **kwargs)
    assert state.current() is None
    # positional use of the original's later arguments is refused, not misread
    with pytest.raises(TypeError, match="positional"):
        synk.fork(2, True, 0, False, 1000, 16)


@wrap_py(itypes=[pt.dvector], otypes=[pt.dvector])
def _work_to_profile(v):
    return v * 2.0


def _profile_names(path: str) -> set:
    return {name for (_, _, name) in pstats.Stats(path).stats}


@pytest.mark.parametrize("n,master_rank", [(2, 0), (3, 1)])
def test_profile_workers_writes_one_profile_per_worker_rank(tmp_path, monkeypatch, n, master_rank):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 3 processes on 2 cores
        synk.fork(n, device="cpu", master_rank=master_rank, profile_workers=True)
    x = pt.dvector("x")
    f = synk.function([x], (_work_to_profile(x), "gather"), mode=MODE)
    assert_array_equal(f(np.arange(7.0)), np.arange(7.0) * 2)
    synk.close()  # workers write their profiles as they leave
    workers = sorted(set(range(n)) - {master_rank})
    assert sorted(glob.glob("*.prof")) == [f"synk_worker_{r}.prof" for r in workers]
    for r in workers:
        names = _profile_names(f"synk_worker_{r}.prof")
        assert "_work_to_profile" in names, f"rank {r}: the user's function is not in its profile"
        assert "worker_call" in names  # the CALL handler (its lane or execute_call runs the share)


def test_profile_workers_into_a_directory(tmp_path):
    target = tmp_path / "profiles"
    target.mkdir()
    synk.fork(2, device="cpu", profile_workers=str(target))
    x = pt.dvector("x")
    f = synk.function([x], (_work_to_profile(x), "gather"), mode=MODE)
    f(np.ones(4))
    synk.close()
    assert sorted(os.listdir(target)) == ["synk_worker_1.prof"]
    assert "_work_to_profile" in _profile_names(str(target / "synk_worker_1.prof"))
    assert not glob.glob(str(tmp_path / "*.prof"))


def test_no_profile_by_default(tmp_path, monkeypatch, fork):
    monkeypatch.chdir(tmp_path)
    fork(2)
    synk.close()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# the collectives' nccl keyword


def test_collectives_nccl_keyword(forked, monkeypatch):
    n = forked
    a = pytensor.shared(np.zeros((3, 2)), name="a")
    f = synk.function([], (a.sum(), "sum"), mode=MODE)
    synk.distribute()
    seen = []
    real_send = shareds.send

    def spy(s, spec, **kw):
        if spec.kind in ("broadcast", "gather", "all_gather", "reduce", "all_reduce"):
            seen.append((spec.kind, spec.cpu))
        return real_send(s, spec, **kw)

    monkeypatch.setattr(shareds, "send", spy)
    value = np.arange(6.0).reshape(3, 2)
    for nccl in (True, False):
        seen.clear()
        synk.broadcast(a, value, nccl=nccl)
        assert_array_equal(synk.gather(a, nd_up=1, nccl=nccl), np.stack([value] * n))
        assert_array_equal(synk.reduce(a, "sum", in_place=False, nccl=nccl), n * value)
        synk.all_reduce(a, "sum", nccl=nccl)
        assert_array_equal(synk.gather(a, nd_up=0, nccl=nccl), np.concatenate([n * value] * n))
        got = synk.all_gather(a, nccl=nccl)
        assert got.shape == (3 * n, 2) and synk.get_shapes(a) == [(3 * n, 2)] * n
        assert f() == n * (n * value.sum() * n)
        synk.set_value(0, a, value)  # back to 3 rows in rank 0 only: shapes now differ
        # nccl=False asks for the CPU path, as a c_ op does; nccl=True leaves the choice to the device
        assert seen == [(kind, not nccl) for kind in
                        ("broadcast", "gather", "reduce", "all_reduce", "gather", "all_gather")]
    synk.broadcast(a)  # equal shapes again
    synk.all_reduce(a, "c_sum", nccl=True)
    assert seen[-1] == ("all_reduce", True)
    for fn, args in ((synk.broadcast, ()), (synk.gather, ()), (synk.all_gather, ()),
                     (synk.reduce, ("sum",)), (synk.all_reduce, ("sum",))):
        with pytest.raises(TypeError, match="nccl must be True or False, got 'no'"):
            fn(a, *args, nccl="no")


# ---------------------------------------------------------------------------
# synk.data(shape=...), get_n_gpu, the namespace


def test_data_with_shape(forked):
    x = pt.dmatrix("x")
    f = synk.function([x], (x * 1.0, "gather"), mode=MODE)
    d = synk.data(var=x, shape=(5, 3))
    assert d.shape == (5, 3) and d.dtype == np.float64 and d.alloc_size == 15
    assert_array_equal(d.data, np.zeros((5, 3)))
    d[:] = np.arange(15.0).reshape(5, 3)
    assert_array_equal(f(d), np.arange(15.0).reshape(5, 3))  # the workers read it in place
    e = synk.data(dtype="int32", shape=(4,), oversize=2.0, name="e")
    assert e.ndim == 1 and e.shape == (4,) and e.alloc_size == 8 and e.name == "e"
    assert synk.data(dtype="float32", ndim=2, shape=[2, 0]).shape == (2, 0)
    assert synk.data(np.ones((2, 2)), shape=(2, 2)).shape == (2, 2)
    with pytest.raises(ValueError, match=r"shape=\(2, 3\) has 2 dimensions, but ndim=1"):
        synk.data(dtype="float64", ndim=1, shape=(2, 3))
    with pytest.raises(ValueError, match=r"shape=\(3,\) has 1 dimensions, but ndim=2 \(from var x\)"):
        synk.data(var=x, shape=(3,))
    with pytest.raises(ValueError, match=r"shape=\(3,\) conflicts with the value's shape \(2,\)"):
        synk.data(np.ones(2), shape=(3,))
    with pytest.raises(ValueError, match=r"shape entries must be non-negative, got \(2, -1\)"):
        synk.data(dtype="float64", shape=(2, -1))
    with pytest.raises(TypeError, match=r"shape must be a tuple of ints, got \(2.5,\)"):
        synk.data(dtype="float64", shape=(2.5,))
    with pytest.raises(ValueError, match="needs a value, a var, a shape, or both dtype and ndim"):
        synk.data(dtype="float64")


def test_get_n_gpu_counts_without_starting_cuda():
    before = set(sys.modules)
    n = synk.get_n_gpu()
    assert isinstance(n, int) and n >= 0
    assert not {"cupy", "jax"} & (set(sys.modules) - before), "the GPU stack was imported here"
    if gpu.stack_missing():
        assert n == 0
    else:
        assert n == (0 if gpu.probe().missing else gpu.probe().n_gpus)


#: The original Synkhronos's public names (its __init__ and API reference).
ORIGINAL_API = {"fork", "close", "function", "distribute", "data", "broadcast", "scatter", "gather",
                "all_gather", "reduce", "all_reduce", "set_value", "get_value", "get_lengths",
                "get_shapes", "get_n_gpu"}


def test_namespace_is_the_public_api():
    names = synk.__all__
    assert len(set(names)) == len(names)
    assert ORIGINAL_API | {"Data", "Function", "SynkError", "WorkerError"} <= set(names)
    for name in ORIGINAL_API:
        assert callable(getattr(synk, name))
    # __all__ is exactly the package's public objects; no submodule is among them
    public = {k for k, v in vars(synk).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set(names)
    assert set(dir(synk)) == set(names) | {"__version__"}
    for internal in ("_batching", "_protocol", "_runtime", "_shareds", "_procs", "_state"):
        assert internal not in dir(synk)
        assert isinstance(getattr(synk, internal), types.ModuleType)  # still importable


# ---------------------------------------------------------------------------
# a synk.data whose dtype PyTensor would cast safely


def test_synk_data_of_a_safe_dtype_is_cast_like_pytensor(forked):
    n = forked
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.sum(axis=0), "sum"), (x * 1.0, "gather")], mode=MODE)
    value = np.arange(12, dtype=np.float32).reshape(6, 2)
    d = synk.data(value)
    want = f.as_pytensor(value)  # PyTensor itself accepts the float32 array
    with pytest.warns(UserWarning, match=r"input 'x' of function .* expects dtype float64, got "
                                         r"synk.data #\d+ of dtype float32: every call casts a copy "
                                         r"of it \(96 bytes now\).*synk.data\(value, dtype='float64'\)"):
        got = f(d)
    for g, w in zip(got, want):
        assert_array_equal(g, w)
        assert g.dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per input and dtype
        assert_array_equal(f(d, batch=[5, 0, 3])[1], value[[5, 0, 3]])
    # a minibatch synk.data keeps its meaning: it holds the batch's rows from 0
    mb = synk.data(value[:3], minibatch=True)
    big = np.arange(40.0).reshape(20, 2)
    y = pt.dmatrix("y")
    g = synk.function([x, y], (x.sum() + y.sum(), "sum"), mode=MODE)
    with pytest.warns(UserWarning, match="input 'y'"):
        assert g(big, mb, batch=slice(4, 7)) == big[4:7].sum() + value[:3].sum()
    # a lossy cast is refused, with the remedy named
    i = pt.fvector("i")
    h = synk.function([i], (i.sum(), "sum"), mode=MODE)
    with pytest.raises(TypeError, match=r"input 'i' of function .* expects dtype float32, got synk.data "
                                        r"#\d+ of dtype float64, which would lose precision: create it "
                                        r"with synk.data\(value, dtype='float32'\)"):
        h(synk.data(np.ones(4)))
    lenient = synk.function([i], (i.sum(), "sum"), mode=MODE, allow_input_downcast=True)
    with pytest.warns(UserWarning, match="float32, got synk.data"):
        assert lenient(synk.data(np.full(2 * n, 0.5))) == n


# ---------------------------------------------------------------------------
# the script in the original's style, unchanged


def _leftovers(pid: int) -> list[str]:
    tag = f"synk.{pid}."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag))


@pytest.mark.parametrize("n", [1, 3])
def test_original_style_script_runs_unchanged(n):
    env = dict(os.environ, PYTENSOR_FLAGS="floatX=float32,mode=FAST_COMPILE", PYTHONHASHSEED="0")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "original_style.py"), str(n)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"original_style.py failed:\n{out}\n{err}"
    assert out.splitlines()[-1] == "original-style script passed", out
    assert _leftovers(proc.pid) == []


# ---------------------------------------------------------------------------
# the original's demo scenarios


def test_demo_reductions_with_build_inputs_and_num_slices(forked, rng):
    x, y = pt.dmatrix("x"), pt.dmatrix("y")
    prod = x.dot(y)
    f = synk.function([x], [prod.mean(axis=0), (prod.sum(axis=0), "sum"), (prod.max(axis=0), "max"),
                            (prod.min(), "min"), (prod.prod(axis=0), "prod")],
                      bcast_inputs=[y], mode=MODE)
    synk.distribute()
    x_dat, y_dat = 0.1 * rng.standard_normal((101, 4)), rng.standard_normal((4, 3))
    want = f.as_theano(x_dat, y_dat)
    xs, ys = f.build_inputs(x_dat, y_dat)
    assert xs.shape == (101, 4) and ys.shape == (4, 3)
    for num_slices in (1, 2, 4):
        for got, w in zip(f(xs, ys, num_slices=num_slices), want):
            assert_allclose(got, w, rtol=1e-10, err_msg=f"num_slices={num_slices}")
    by_name = f.build_inputs(x=x_dat, y=y_dat, minibatch=[False, False])
    assert_allclose(f(*by_name)[1], want[1], rtol=1e-12)


def test_demo_data_life_cycle(forked, rng):
    x = pt.dmatrix("x")
    f = synk.function([x], (x * 1.0, "gather"), mode=MODE)
    sets = [rng.standard_normal((k, 3)) for k in (5, 200, 210, 10)]
    d = synk.data(sets[0])
    assert_array_equal(f(d), sets[0])
    d[3] = 0
    d[:2] = sets[0][2:4]
    expect = sets[0].copy()
    expect[3] = 0
    expect[:2] = sets[0][2:4]
    assert_array_equal(f(d), expect)  # writes through the master's view reach the workers
    d.set_value(sets[1], oversize=1.1)
    alloc = d.alloc_size
    assert alloc == int(200 * 3 * 1.1)
    d.set_value(sets[2])  # fits: no new allocation
    assert d.alloc_size == alloc and len(d) == 210
    assert_array_equal(f(d), sets[2])
    d.set_length(200)
    d[:] = sets[1]
    assert d.alloc_size == alloc
    assert_array_equal(f(d), sets[1])
    d.set_value(sets[3])  # shrinks the data, not the allocation
    assert d.alloc_size == alloc
    assert_array_equal(f(d), sets[3])
    d.free_memory()
    assert d.alloc_size == 0 and d.size == 0
    d.set_value(sets[3])
    assert d.alloc_size == 30
    assert_array_equal(f(d), sets[3])
    as_f32 = sets[3].astype(np.float32)
    with pytest.raises(TypeError, match="would lose information"):
        d.condition_data(sets[3].astype(np.complex128))
    assert d.condition_data(as_f32).dtype == np.float64  # a safe cast
    ints = synk.data(np.zeros((2, 3), dtype=np.int32))
    ints.set_value(sets[3][:2] * 10, force_cast=True)
    assert ints.dtype == np.int32
    assert_array_equal(ints.data, (sets[3][:2] * 10).astype(np.int32))


def test_demo_shared_variables_with_differing_shapes(forked, rng):
    n = forked
    s_x = pytensor.shared(np.ones((10, 4)), name="s_x")
    s_y = pytensor.shared(np.zeros((4, 5)), name="s_y")
    f = synk.function([], (s_x.dot(s_y).mean(axis=0), "avg"), sliceable_shareds=[s_x], mode=MODE)
    synk.distribute()
    assert list(synk.get_lengths(s_x)) == [10] * n
    x_dat = rng.standard_normal((8 * n + n - 1, 4))  # rows do not split evenly
    y_dat = rng.standard_normal((4, 5))
    synk.scatter(s_x, x_dat)
    synk.broadcast(s_y, y_dat)
    lengths = [8 + (1 if r < n - 1 else 0) for r in range(n)]
    assert list(synk.get_lengths(s_x)) == lengths
    assert synk.get_shapes(s_x) == [(k, 4) for k in lengths]
    assert_allclose(synk.gather(s_x, nd_up=0), x_dat)
    if n > 1 and len(set(lengths)) > 1:
        with pytest.raises(ValueError, match="use nd_up=0"):
            synk.gather(s_x, nd_up=1)
    want = (x_dat @ y_dat).mean(axis=0)
    assert_allclose(f(), want, rtol=1e-12)
    assert_allclose(f(num_slices=2), want, rtol=1e-12)
    synk.set_value(rank=n - 1, shared_vars=s_x, values=x_dat[:3])
    assert synk.get_shapes(s_x)[-1] == (3, 4)
    assert_allclose(synk.get_value(n - 1, s_x), x_dat[:3])
    full = synk.all_gather(s_x)
    assert synk.get_shapes(s_x) == [full.shape] * n
    assert len(full) == sum(lengths[:-1]) + 3
    synk.set_value(0, s_x, np.ones((2, 4)))
    synk.scatter(s_x, np.ones((2 * n, 4)))
    synk.all_reduce(s_x, "avg")
    assert_allclose(synk.gather(s_x, nd_up=1), np.ones((n, 2, 4)))


def test_demo_batch_and_minibatch_with_slices(forked, rng):
    x, w, y = pt.dmatrix("x"), pt.dmatrix("w"), pt.dmatrix("y")
    f = synk.function([x, w], (((x + w) @ y).sum(axis=0), "sum"), bcast_inputs=[y], mode=MODE)
    x_dat = 0.01 * rng.standard_normal((300, 6))
    w_dat = 0.01 * rng.standard_normal((40, 6))
    y_dat = rng.standard_normal((6, 4))
    xs, ws, ys = synk.data(x_dat), synk.data(w_dat, minibatch=True), synk.data(y_dat)
    for batch in (40, slice(100, 140), rng.integers(0, 300, size=40), list(range(5, 45))):
        rows = x_dat[:batch] if isinstance(batch, int) else x_dat[batch]
        want = f.as_theano(rows, w_dat, y_dat)
        for num_slices in (1, 3):
            assert_allclose(f(xs, ws, ys, batch=batch, num_slices=num_slices), want, rtol=1e-10,
                            err_msg=f"batch={batch!r}, num_slices={num_slices}")


def test_demo_batch_s_selections(forked, rng):
    n = forked
    rows = 30
    s_x = pytensor.shared(np.zeros((rows, 5)), name="s_x")
    s_y = pytensor.shared(np.zeros((5, 2)), name="s_y")
    f = synk.function([], (s_x.dot(s_y).sum(axis=0), "sum"), sliceable_shareds=[s_x], mode=MODE)
    x_dat = rng.standard_normal((rows * n, 5))
    y_dat = rng.standard_normal((5, 2))
    synk.scatter(s_x, x_dat)
    synk.broadcast(s_y, y_dat)
    own = [x_dat[r * rows:(r + 1) * rows] for r in range(n)]
    one_list = rng.integers(0, rows, size=12)
    forms = [
        (slice(10, 25), [o[10:25] for o in own]),
        (one_list, [o[one_list] for o in own]),
        ([slice(r, 10 + r) for r in range(n)], [o[r:10 + r] for r, o in enumerate(own)]),
        ([rng.integers(0, rows, size=7) for _ in range(n)], None),
    ]
    lists = forms[3][0]
    forms[3] = (lists, [o[idx] for o, idx in zip(own, lists)])
    for batch_s, parts in forms:
        want = (np.concatenate(parts) @ y_dat).sum(axis=0)
        for num_slices in (1, 4):
            assert_allclose(f(batch_s=batch_s, num_slices=num_slices), want, rtol=1e-10)
