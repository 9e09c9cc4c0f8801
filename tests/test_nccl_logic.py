"""The NCCL communicator's logic, on the CPU, with the CuPy stand-in of tests/fakegpu.

Ranks are threads of this process, each with a shared-memory communicator of
its own (they agree through it, as processes do) and a fake NCCL that reads
and writes by pointer. What this proves: layouts are agreed before NCCL is
called, every rank makes the same NCCL calls with the same counts, identity
elements stand in for ranks with nothing to add, all-gathers are padded and
trimmed, averages follow the CPU path's weights, unsupported dtypes and
failures are errors in every rank. What it does not prove: anything about
CUDA, NCCL or DLPack on a GPU (tests/test_gpu.py, on a GPU machine).
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from synkhronos._arrays import concat
from synkhronos.collectives import PeerFailed, ShmCommunicator
from synkhronos.collectives.nccl import avg_factors, reduce_plan
from synkhronos.collectives.ops import combine
from synkhronos.errors import SynkError
from synkhronos._procs.shmem import new_prefix, unlink_prefix

FAKE = Path(__file__).resolve().parent / "fakegpu"


@pytest.fixture
def fake_cupy(monkeypatch):
    """The CuPy stand-in as ``cupy`` for this test only."""
    for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE))
    import cupy

    assert getattr(cupy, "FAKE", False), "a real CuPy was imported instead of the stand-in"
    cupy.cuda.nccl.calls.clear()
    yield cupy
    for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        del sys.modules[name]


@pytest.fixture
def world(fake_cupy):
    """Factory: ``world(n)`` -> n NcclCommunicators (rank order), closed afterwards."""
    from synkhronos.collectives.nccl import NcclCommunicator, new_unique_id

    made = []

    def _world(n):
        prefix = new_prefix()
        shms = [ShmCommunicator(prefix, 0, n, 0, create=True)]
        shms += [ShmCommunicator(prefix, r, n, 0, create=False) for r in range(1, n)]
        uid = new_unique_id()
        comms = run(n, lambda r: NcclCommunicator(shms[r], uid))
        made.append((prefix, shms, comms))
        return [comms[r] for r in range(n)]

    yield _world
    for prefix, shms, comms in made:
        for c in comms.values():
            c.close()
        for s in reversed(shms):
            s.close()
        unlink_prefix(prefix)


def run(n, fn):
    """``fn(rank)`` in n threads at once; results by rank; the first error is raised."""
    results, errors = {}, {}

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[min(errors)]
    return results


def run_all(n, fn):
    """As run(), but returns (results, errors) by rank."""
    results, errors = {}, {}

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    return results, errors


def host(x):
    return None if x is None else x.get()


# ---------------------------------------------------------------------------
# Pure functions.


@pytest.mark.parametrize("weights,expect", [
    ([5, 5, 5], [(1.0, 1 / 3)] * 3),            # equal: a sum times the reciprocal
    ([1], [(1.0, 1.0)]),
    ([4, 3, 3], [(1.0, 0.4), (0.75, 0.4), (0.75, 0.4)]),
    ([0, 0], [(1.0, 0.5), (1.0, 0.5)]),           # no weight at all: each counts once
])
def test_avg_factors(weights, expect):
    total = sum(weights) or len(weights)
    for w, (pre, post) in zip(weights, expect):
        got = avg_factors(weights, w)
        assert got == pytest.approx((pre, post))
        assert got[0] * got[1] == pytest.approx((w if sum(weights) else 1) / total)


@pytest.mark.parametrize("dtype,op,work,result", [
    ("float32", "avg", "float32", "float32"),
    ("float16", "sum", "float16", "float16"),
    ("float16", "avg", "float32", "float16"),  # in float32, as on the CPU: no overflow where the mean fits
    ("int32", "avg", "float64", "float64"),
    ("int16", "sum", "int32", "int16"),
    ("uint16", "max", "uint32", "uint16"),
    ("bool", "sum", "uint8", "bool"),
    ("bool", "avg", "float64", "float64"),
    ("complex64", "avg", "complex64", "complex64"),
])
def test_reduce_plan(dtype, op, work, result):
    got = reduce_plan(dtype, op)
    assert (str(got[0]), str(got[3])) == (work, result)


@pytest.mark.parametrize("dtype,op", [("complex128", "max"), ("datetime64[s]", "sum"),
                                      ("object", "sum"), ("U3", "min")])
def test_reduce_plan_refuses_with_the_dtype_named(dtype, op):
    with pytest.raises(TypeError, match=re.escape(f"NCCL cannot {op}-reduce arrays of dtype "
                                                  f"{np.dtype(dtype)}; use op 'c_{op}'")):
        reduce_plan(dtype, op)


# ---------------------------------------------------------------------------
# Collectives over 1, 2 and 3 ranks.

N = [1, 2, 3]
OPS = ["avg", "sum", "prod", "max", "min"]


def values(n, shape=(4, 3), dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 3).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint8", "int16", "bool"])
def test_all_reduce_matches_the_cpu_path(world, n, op, dtype):
    comms = world(n)
    vals = [v.astype(dtype) for v in values(n, dtype=np.float64)]
    weights = [float(r + 2) for r in range(n)]  # uneven row counts
    got = run(n, lambda r: comms[r].all_reduce([vals[r]], op, weight=weights[r]))
    want = combine([v.copy() for v in vals], op, weights)
    for r in range(n):
        out = host(got[r][0])
        assert out.dtype == want.dtype, (out.dtype, want.dtype)
        assert_allclose(out, want, rtol=2e-6 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("root", ["first", "last"])
def test_reduce_only_root_gets_it(world, n, root):
    comms = world(n)
    root = 0 if root == "first" else n - 1
    vals = values(n)
    got = run(n, lambda r: comms[r].reduce([vals[r], 2 * vals[r]], "sum", root=root))
    for r in range(n):
        if r == root:
            assert_allclose(host(got[r][0]), np.sum(vals, axis=0))
            assert_allclose(host(got[r][1]), 2 * np.sum(vals, axis=0))
        else:
            assert got[r] is None


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", OPS)
def test_ranks_without_rows_send_identity_elements(world, n, op):
    comms = world(n)
    vals = values(n, dtype=np.float32)
    absent = {1}  # rank 1 computed on no rows
    weights = [3.0, 0.0, 2.0][:n]
    got = run(n, lambda r: comms[r].all_reduce(None if r in absent else [vals[r]], op, weight=weights[r]))
    present = [r for r in range(n) if r not in absent]
    want = combine([vals[r] for r in present], op, [weights[r] for r in present])
    for r in range(n):
        assert_allclose(host(got[r][0]), want, rtol=1e-6)


def test_nobody_contributes(world):
    comms = world(3)
    got = run(3, lambda r: comms[r].all_reduce(None, "sum"))
    assert got == {0: None, 1: None, 2: None}


@pytest.mark.parametrize("n", N)
def test_complex_sum_and_avg(world, n):
    comms = world(n)
    vals = [v + 1j * (v + 1) for v in values(n)]
    for op in ("sum", "avg"):
        got = run(n, lambda r: comms[r].all_reduce([vals[r].astype(np.complex64)], op))
        want = combine([v.astype(np.complex64) for v in vals], op)
        assert_allclose(host(got[0][0]), want, rtol=1e-6)


@pytest.mark.parametrize("n", N)
def test_all_gather_pads_and_trims_uneven_parts(world, fake_cupy, n):
    comms = world(n)
    # uneven lengths, one rank with no rows at all, odd byte counts (int16, bool)
    parts = [np.arange(3 * (r + 1) * 5, dtype=np.int16).reshape(-1, 5) + r for r in range(n)]
    flags = [np.arange(r + 2) % 2 == 0 for r in range(n)]
    scal = [np.float64(r) for r in range(n)]
    none_rank = 1 if n > 1 else None
    mine = lambda r: None if r == none_rank else [parts[r], flags[r], np.asarray(scal[r])]  # noqa: E731
    got = run(n, lambda r: comms[r].all_gather(mine(r)))
    for r in range(n):
        for i, expected in enumerate((parts, flags, scal)):
            for q in range(n):
                piece = got[r][i][q]
                if q == none_rank:
                    assert piece is None
                else:
                    assert_array_equal(host(piece), expected[q])
                    assert host(piece).dtype == np.asarray(expected[q]).dtype
    counts = {c[2] for c in fake_cupy.cuda.nccl.calls if c[1] == "allGather"}
    assert all(c % 16 == 0 for c in counts), "each rank's part is padded to 16 bytes"


@pytest.mark.parametrize("n", N)
def test_gather_with_join_on_root_only(world, n):
    comms = world(n)
    parts = [np.full((r + 1, 2), r, dtype=np.float32) for r in range(n)]
    joined = run(n, lambda r: comms[r].gather([parts[r]], root=n - 1,
                                               join=lambda i, ps: concat(ps)))
    for r in range(n):
        if r == n - 1:
            assert_array_equal(host(joined[r][0]), np.concatenate(parts))
        else:
            assert joined[r] is None


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("dtype", ["float64", "bool", "int16", "complex64"])
def test_broadcast_any_dtype_and_0d(world, n, dtype):
    comms = world(n)
    src = [np.arange(7).astype(dtype), np.asarray(np.arange(1).astype(dtype)[0]), np.empty((0, 3), dtype)]
    got = run(n, lambda r: comms[r].broadcast(src if r == 0 else None, root=0))
    for r in range(n):
        for a, b in zip(got[r], src):
            assert_array_equal(host(a), b)
            assert host(a).shape == b.shape and host(a).dtype == b.dtype


@pytest.mark.parametrize("n", [2, 3])
def test_a_failed_rank_fails_the_collective_everywhere(world, fake_cupy, n):
    comms = world(n)
    vals = values(n)
    res, errs = run_all(n, lambda r: comms[r].all_reduce([vals[r]], "sum", failed=(r == 1)))
    assert set(errs) == set(range(n)) and all(isinstance(e, PeerFailed) for e in errs.values())
    assert not [c for c in fake_cupy.cuda.nccl.calls if c[1] == "allReduce"], "NCCL was entered"
    # the communicator is usable afterwards
    got = run(n, lambda r: comms[r].all_reduce([vals[r]], "max"))
    assert_allclose(host(got[0][0]), np.max(vals, axis=0))


@pytest.mark.parametrize("n", [2, 3])
def test_an_error_preparing_buffers_in_one_rank_stops_every_rank(world, fake_cupy, n):
    class Unreadable:
        dtype, shape, size = np.dtype(np.float64), (3,), 3

        def __array__(self, *a, **k):
            raise RuntimeError("boom: cannot read this array")

    comms = world(n)
    res, errs = run_all(n, lambda r: comms[r].all_reduce(
        [Unreadable() if r == 1 else np.ones(3)], "sum"))
    assert isinstance(errs[1], RuntimeError) and "boom" in str(errs[1])
    assert all(isinstance(errs[r], PeerFailed) for r in range(n) if r != 1)
    assert not [c for c in fake_cupy.cuda.nccl.calls if c[1] == "allReduce"], "NCCL was entered"


@pytest.mark.parametrize("n", [1, 3])
def test_unsupported_dtype_is_a_type_error_in_every_rank(world, n):
    comms = world(n)
    res, errs = run_all(n, lambda r: comms[r].all_reduce([np.arange(3).astype("datetime64[s]")], "sum"))
    assert set(errs) == set(range(n))
    for e in errs.values():
        assert isinstance(e, TypeError) and "dtype datetime64[s]" in str(e) and "c_sum" in str(e)
    res, errs = run_all(n, lambda r: comms[r].all_gather([np.array(["ab", "c"])]))
    assert set(errs) == set(range(n)) and all("NCCL cannot gather" in str(e) for e in errs.values())


def test_mismatched_layouts_are_a_value_error_in_every_rank(world):
    comms = world(2)
    res, errs = run_all(2, lambda r: comms[r].all_reduce([np.ones(3 + r)], "sum"))
    assert set(errs) == {0, 1}
    for e in errs.values():
        assert isinstance(e, ValueError) and "rank 0 holds" in str(e) and "rank 1 holds" in str(e)


def test_barrier(world):
    comms = world(3)
    assert run(3, lambda r: comms[r].barrier()) == {0: None, 1: None, 2: None}


# ---------------------------------------------------------------------------
# One rank: nobody to agree with (issue 48).


def _count_exchanges(monkeypatch, comm):
    """Count every shared-memory exchange the communicator's ShmCommunicator makes."""
    counts = {"all_gather": 0, "_publish": 0, "barrier": 0}
    shm = comm._shm
    for name in counts:
        real = getattr(shm, name)

        def counting(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(shm, name, counting)
    return counts


ONE_RANK_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32",
                   "bool", "complex64"]


def test_one_rank_makes_no_shared_memory_exchange_and_matches_combine(world, fake_cupy, monkeypatch):
    (comm,) = world(1)
    counts = _count_exchanges(monkeypatch, comm)
    rng = np.random.default_rng(48)
    done = 0
    for step in range(120):
        dtype = np.dtype(ONE_RANK_DTYPES[rng.integers(len(ONE_RANK_DTYPES))])
        op = OPS[rng.integers(len(OPS))]
        if dtype.kind == "c" and op not in ("sum", "avg"):
            op = "sum"
        shapes = [[(), (1,), (7, 3), (0, 2), (5,)][i] for i in rng.integers(5, size=rng.integers(1, 4))]
        raw = [np.asarray(rng.standard_normal(s) + (1j * rng.standard_normal(s) if dtype.kind == "c" else 0))
               for s in shapes]
        vals = [(np.abs(r) if dtype.kind == "u" else r * (5 if dtype.kind in "iu" else 1)).astype(dtype)
                for r in raw]
        weight = float(rng.integers(1, 9))
        if step % 3 == 0:
            got = comm.reduce(vals, op, root=0, weight=weight)
        else:
            got = comm.all_reduce(vals, op, weight=weight)
        assert len(got) == len(vals)
        for g, v in zip(got, vals):
            want = combine([v.copy()], op, [weight])
            out = host(g)
            assert out.dtype == want.dtype and out.shape == want.shape, (dtype, op, out.dtype, want.dtype)
            assert_array_equal(out, want, err_msg=f"{dtype} {op}")
        done += 1
    assert comm.all_reduce(None, "sum") is None  # a rank with nothing: nobody contributes
    gathered = comm.all_gather([np.arange(5, dtype=np.int16), np.ones((2, 3), dtype=bool)])
    assert_array_equal(host(gathered[0][0]), np.arange(5, dtype=np.int16))
    assert_array_equal(host(gathered[1][0]), np.ones((2, 3), dtype=bool))
    sent = comm.broadcast([np.arange(3.0)], root=0)
    assert_array_equal(host(sent[0]), np.arange(3.0))
    assert done == 120 and counts == {"all_gather": 0, "_publish": 0, "barrier": 0}, counts
    assert [c for c in fake_cupy.cuda.nccl.calls if c[1] in ("allReduce", "reduce")], "NCCL was not used"


def test_one_rank_failed_raises_peer_failed_and_broken_still_raises(world, fake_cupy, monkeypatch):
    (comm,) = world(1)
    counts = _count_exchanges(monkeypatch, comm)
    v = np.arange(4.0)
    for call in (lambda: comm.all_reduce([v], "sum", failed=True),
                 lambda: comm.reduce([v], "max", root=0, failed=True),
                 lambda: comm.all_gather([v], failed=True),
                 lambda: comm.broadcast([v], root=0, failed=True)):
        with pytest.raises(PeerFailed) as caught:
            call()
        assert caught.value.args == ([0],)  # as the shared-memory exchange raises it
    assert not fake_cupy.cuda.nccl.calls, "NCCL was entered"

    class Unreadable:
        dtype, shape, size = np.dtype(np.float64), (3,), 3

        def __array__(self, *a, **k):
            raise RuntimeError("boom: cannot read this array")

    with pytest.raises(RuntimeError, match="boom"):  # an error preparing is raised as it is
        comm.all_reduce([Unreadable()], "sum")
    assert_array_equal(host(comm.all_reduce([v], "sum")[0]), v)  # usable afterwards
    comm.abort("an earlier failure")
    with pytest.raises(SynkError, match=r"NCCL communicator of rank 0 was aborted after an earlier failure "
                                        r"\(an earlier failure\)"):
        comm.all_reduce([v], "sum")
    with pytest.raises(PeerFailed):  # a failure is reported before a broken communicator, as before
        comm.all_reduce([v], "sum", failed=True)
    assert counts == {"all_gather": 0, "_publish": 0, "barrier": 0}, counts


def test_reduce_plan_is_kept():
    reduce_plan.cache_clear()
    first = reduce_plan(np.dtype("float32"), "avg")
    assert reduce_plan(np.dtype("float32"), "avg") is first
    assert reduce_plan.cache_info().hits == 1
    with pytest.raises(TypeError):
        reduce_plan(np.dtype("complex128"), "max")
    with pytest.raises(TypeError):  # refusals are not kept: they raise every time
        reduce_plan(np.dtype("complex128"), "max")


# ---------------------------------------------------------------------------
# In place: one buffer JAX (here the stand-in's CuPy arrays) and NCCL both use (issue 48).

IN_PLACE_DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint32", "bool",
                   "complex64", "int16"]


def _expect_in_place(dtype, op) -> bool:
    """NCCL reduces the dtype in its own memory: no avg of integers or bools (float64) or of
    float16 (float32), no wider work dtype (int16 sums as int32), complex numbers only as
    sums and averages."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return op in ("sum", "avg")
    if (dtype.kind in "iub" or dtype.name == "float16") and op == "avg":  # (float16's avg: in float32)
        return False
    return dtype.name != "int16"


def _random_values(rng, n, dtype, shape):
    dtype = np.dtype(dtype)
    out = []
    for _ in range(n):
        raw = rng.standard_normal(shape) * (5 if dtype.kind in "iu" else 2)
        if dtype.kind == "c":
            raw = raw + 1j * rng.standard_normal(shape)
        out.append(np.asarray(np.abs(raw) if dtype.kind in "ub" else raw).astype(dtype))
    return out


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", IN_PLACE_DTYPES)
def test_all_reduce_in_place_lands_in_the_arrays_and_equals_combine(world, fake_cupy, n, op, dtype):
    if np.dtype(dtype).kind == "c" and op not in ("sum", "avg"):
        pytest.skip("NCCL reduces complex numbers by sum and avg only")
    comms = world(n)
    rng = np.random.default_rng([n, OPS.index(op), IN_PLACE_DTYPES.index(dtype)])
    shapes = [(4, 3), (), (1,), (0, 2)]
    vals = [_random_values(rng, n, dtype, s) for s in shapes]  # per array, per rank
    mine = {r: [fake_cupy.asarray(v[r]) for v in vals] for r in range(n)}
    # the route with new buffers, on copies: what the in-place route must equal bit for bit
    new = run(n, lambda r: comms[r].all_reduce([fake_cupy.asarray(v[r]) for v in vals], op))
    synced = fake_cupy.cuda.runtime.synchronized[0]
    got = run(n, lambda r: comms[r].all_reduce(mine[r], op, in_place=True))
    expect = _expect_in_place(dtype, op)
    assert fake_cupy.cuda.runtime.synchronized[0] - synced == (n if expect else 0)
    for i, v in enumerate(vals):
        want = combine([x.copy() for x in v], op)
        for r in range(n):
            out = got[r][i]
            written = out is mine[r][i]
            assert written == (expect and v[r].size > 0), (dtype, op, i, r)
            assert host(out).dtype == want.dtype and host(out).shape == want.shape
            assert_array_equal(host(out), host(new[r][i]), err_msg=f"{dtype} {op} array {i} rank {r}")
            if want.dtype.kind in "fc":
                assert_allclose(host(out), want, rtol=2e-3 if dtype == "float16" else 2e-6)
            else:
                assert_array_equal(host(out), want)
            if not written:  # a refusal leaves the input as it was
                assert_array_equal(host(mine[r][i]), v[r])


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool"])
def test_reduce_in_place_writes_only_roots_arrays_and_equals_combine(world, fake_cupy, n, op, dtype):
    """The output reduction of a call: root's arrays (its own outputs) take the result in
    place where NCCL can; the other ranks' arrays are never written; uneven weights
    (a multiply before the sum) and ``in_place=False`` leave root's arrays as they were."""
    comms = world(n)
    rng = np.random.default_rng([n, OPS.index(op), len(dtype)])
    shapes = [(), (1,), (7, 3)]
    for root in (0, n - 1):
        for weights in ([1.0] * n, [float(r + 1) for r in range(n)]):
            for allowed in (True, False):
                vals = [_random_values(rng, n, dtype, s) for s in shapes]
                mine = {r: [fake_cupy.asarray(v[r]) for v in vals] for r in range(n)}
                got = run(n, lambda r: comms[r].reduce(mine[r], op, root, weight=weights[r], in_place=allowed))
                uneven = op == "avg" and weights[root] != max(weights)  # root multiplies first
                expect = allowed and _expect_in_place(dtype, op) and not uneven
                for i, v in enumerate(vals):
                    want = combine([x.copy() for x in v], op, weights if op == "avg" else None)
                    out = got[root][i]
                    assert (out is mine[root][i]) == expect, (dtype, op, root, weights, allowed, i)
                    assert host(out).dtype == want.dtype and host(out).shape == want.shape
                    if want.dtype.kind in "fc":
                        assert_allclose(host(out), want, rtol=2e-6, atol=1e-12)
                    else:
                        assert_array_equal(host(out), want)
                    for r in range(n):
                        assert got[r] is None or r == root
                        if r != root or not expect:
                            assert_array_equal(host(mine[r][i]), v[r], err_msg=f"rank {r} array {i} written")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_float_max_and_min_keep_nan_as_the_cpu_path(world, fake_cupy, n, dtype):
    """NCCL's float max and min are fmaxf/fminf, which drop a NaN (the stand-in does the
    same); the CPU path's are numpy's maximum/minimum, which keep it. Random NaN (and
    infinities) on random ranks, every route (new buffers, in place, a reduce to a root,
    a rank with nothing to add): NaN exactly where numpy's combination has it, and the
    same bits elsewhere."""
    comms = world(n)
    rng = np.random.default_rng([n, len(dtype)])
    for case in range(12):
        shape = [(5, 4), (), (1,), (33,)][case % 4]
        vals = _random_values(rng, n, dtype, shape)
        for v in vals:  # NaN, infinities, or nothing special, per rank
            flat = v.reshape(-1)
            for special in (np.nan, np.inf, -np.inf):
                flat[rng.random(flat.size) < rng.choice([0.0, 0.2, 1.0], p=[0.4, 0.4, 0.2]) / 3] = special
        absent = {int(rng.integers(n))} if case % 3 == 2 else set()
        op = ["max", "min"][case % 2]
        want = combine([vals[r].copy() for r in range(n) if r not in absent], op)
        root = int(rng.integers(n))
        for route in ("new", "in_place", "reduce", "reduce_in_place"):
            mine = {r: None if r in absent else [fake_cupy.asarray(vals[r])] for r in range(n)}
            if route.startswith("reduce"):
                got = run(n, lambda r: comms[r].reduce(mine[r], op, root, in_place=route.endswith("place")))
                outs = {root: got[root]}
            else:
                outs = run(n, lambda r: comms[r].all_reduce(mine[r], op, in_place=route == "in_place"))
            for r, out in outs.items():
                out = host(out[0])
                where = f"{dtype} {op} case {case} {route} rank {r}"
                assert_array_equal(np.isnan(out), np.isnan(want), err_msg=where)
                assert_array_equal(out, want, err_msg=where)


@pytest.mark.parametrize("n", [2, 3])
def test_in_place_refusals_return_new_arrays_and_leave_the_inputs(world, fake_cupy, n):
    comms = world(n)
    vals = values(n, dtype=np.float32)

    def check(got, inputs, written, want):
        for r in range(n):
            if got[r] is None:
                continue
            assert (got[r][0] is inputs[r][0]) == written(r), r
            assert_allclose(host(got[r][0]), want, rtol=2e-6)
            if not written(r):
                assert_array_equal(host(inputs[r][0]), vals[r])

    def fresh():
        return {r: [fake_cupy.asarray(vals[r])] for r in range(n)}

    ins = fresh()  # in_place=False (the default): never written
    check(run(n, lambda r: comms[r].all_reduce(ins[r], "sum")), ins, lambda r: False, np.sum(vals, axis=0))
    ins = fresh()  # per array, False
    check(run(n, lambda r: comms[r].all_reduce(ins[r], "sum", in_place=[False])), ins, lambda r: False,
          np.sum(vals, axis=0))
    ints = {r: [fake_cupy.asarray(vals[r].astype(np.int32))] for r in range(n)}  # avg of ints: float64
    got = run(n, lambda r: comms[r].all_reduce(ints[r], "avg", in_place=True))
    assert all(got[r][0] is not ints[r][0] and host(got[r][0]).dtype == np.float64 for r in range(n))
    weights = [float(r + 1) for r in range(n)]  # uneven: only the heaviest rank multiplies by 1 first
    ins = fresh()
    check(run(n, lambda r: comms[r].all_reduce(ins[r], "avg", weight=weights[r], in_place=True)), ins,
          lambda r: r == n - 1, combine([v.copy() for v in vals], "avg", weights))
    ins = fresh()  # a rank with nothing: identity elements from it, the others still in place
    got = run(n, lambda r: comms[r].all_reduce(None if r == 1 else ins[r], "max", in_place=True))
    check(got, ins, lambda r: r != 1, np.max([vals[r] for r in range(n) if r != 1], axis=0))
    assert_allclose(host(got[1][0]), np.max([vals[r] for r in range(n) if r != 1], axis=0))


def test_in_place_per_array_and_non_contiguous(world, fake_cupy, monkeypatch):
    (comm,) = world(1)
    counts = _count_exchanges(monkeypatch, comm)
    a, b = fake_cupy.asarray(np.arange(6.0)), fake_cupy.asarray(np.arange(3.0))
    strided = fake_cupy.asarray(np.arange(12.0).reshape(3, 4))[:, 1]  # not contiguous: new buffers
    got = comm.all_reduce([a, b, strided, np.ones(2)], "sum", in_place=[True, False, True, True])
    assert got[0] is a and got[1] is not b and got[2] is not strided and not isinstance(got[3], np.ndarray)
    assert_array_equal(host(got[2]), np.arange(12.0).reshape(3, 4)[:, 1])
    assert counts == {"all_gather": 0, "_publish": 0, "barrier": 0}, counts
    calls = [c for c in fake_cupy.cuda.nccl.calls if c[1] == "allReduce"]
    assert len(calls) == 4
    got = comm.all_reduce([a, b], "sum", in_place=[True])  # a short list: False for the rest
    assert got[0] is a and got[1] is not b


# ---------------------------------------------------------------------------
# The kept plan of one process (issue 48): NCCL in place, no agreement per step.


def test_plan_runs_in_place_with_one_rank_and_matches_combine(world, fake_cupy, monkeypatch):
    (comm,) = world(1)
    counts = _count_exchanges(monkeypatch, comm)
    rng = np.random.default_rng(4848)
    kinds = [(d, op) for d in IN_PLACE_DTYPES for op in OPS if _expect_in_place(d, op)]
    for step in range(60):
        dtype, op = kinds[rng.integers(len(kinds))]
        shapes = [[(), (1,), (7, 3), (5,)][i] for i in rng.integers(4, size=rng.integers(1, 4))]
        vals = [_random_values(rng, 1, dtype, s)[0] for s in shapes]
        layout = tuple((np.dtype(dtype), s) for s in shapes)
        plan = comm.plan("all_reduce", layout, op)
        assert plan is not None and plan.needs_exclusive and not plan.out_of_place, (dtype, op)
        assert plan.fingerprint == comm.plan("all_reduce", layout, op).fingerprint
        arrays = [fake_cupy.asarray(v) for v in vals]
        before = len(fake_cupy.cuda.nccl.calls)
        for _ in range(2):  # the same arrays twice: the second run checks only what can change
            assert plan.run(arrays) is True
        assert len(fake_cupy.cuda.nccl.calls) - before == 2 * len(arrays)
        for a, v in zip(arrays, vals):
            want = combine([v.copy()], op)
            assert host(a).dtype == want.dtype and host(a).shape == want.shape
            assert_array_equal(host(a), want, err_msg=f"{dtype} {op}")
    assert counts == {"all_gather": 0, "_publish": 0, "barrier": 0}, counts


def test_plan_refusals(world, fake_cupy):
    (one,) = world(1)
    f32 = np.dtype(np.float32)
    lay = ((f32, (3,)),)
    assert one.plan("broadcast", lay, "sum") is None
    for layout, op in [(((np.dtype(np.int32), (3,)),), "avg"), (((np.dtype(np.int16), (3,)),), "sum"),
                       (((np.dtype(np.complex64), (3,)),), "max"), (((f32, (0, 2)),), "sum"),
                       (((np.dtype("datetime64[s]"), (3,)),), "sum"), (((None, None),), "sum"),
                       (lay + ((np.dtype(np.int64), (2,)),), "avg")]:
        assert one.plan("all_reduce", layout, op) is None, (layout, op)
    assert world(2)[0].plan("all_reduce", lay, "sum") is None  # several processes: the full path
    plan = one.plan("all_reduce", lay, "sum")
    a = fake_cupy.asarray(np.arange(3, dtype=np.float32))
    calls = len(fake_cupy.cuda.nccl.calls)
    for values in ([fake_cupy.asarray(np.arange(3.0))], [fake_cupy.asarray(np.arange(4, dtype=np.float32))],
                   [np.arange(3, dtype=np.float32)], [fake_cupy.asarray(np.arange(6, dtype=np.float32))[::2]],
                   [a, a], []):
        assert plan.run(values) is False  # another dtype, shape, numpy, not contiguous, count
    assert len(fake_cupy.cuda.nccl.calls) == calls, "a refused run sent something"
    assert plan.run([a]) is True
    one.abort("an earlier failure")
    assert plan.run([a]) is False  # the full path raises the broken communicator's error
    assert one.plan("all_reduce", lay, "sum") is None


@pytest.mark.parametrize("n", N)
@pytest.mark.parametrize("op", OPS)
def test_reduce_reads_device_arrays_where_they_are(world, fake_cupy, n, op):
    """Device arrays NCCL reduces in their own dtype are sent from their own buffers
    (no conversion): the result on root equals combine's; no input changes."""
    comms = world(n)
    rng = np.random.default_rng([7, n, OPS.index(op)])
    for dtype in ("float32", "int64", "bool", "float16", "int16"):
        vals = _random_values(rng, n, dtype, (5, 2))
        ins = {r: [fake_cupy.asarray(vals[r])] for r in range(n)}
        weights = [1.0 + (r % 2) for r in range(n)]
        got = run(n, lambda r: comms[r].reduce(ins[r], op, root=n - 1, weight=weights[r]))
        want = combine([v.copy() for v in vals], op, weights)
        out = host(got[n - 1][0])
        assert out.dtype == want.dtype and out.shape == want.shape, (dtype, op)
        if want.dtype.kind in "fc":
            assert_allclose(out, want, rtol=2e-3 if dtype == "float16" else 2e-6)
        else:
            assert_array_equal(out, want)
        assert all(got[r] is None for r in range(n - 1))
        for r in range(n):
            assert_array_equal(host(ins[r][0]), vals[r])


def test_device_arrays_are_read_without_conversion(world, fake_cupy, monkeypatch):
    from synkhronos.collectives import nccl

    converted = []
    real = nccl.to_cupy
    monkeypatch.setattr(nccl, "to_cupy", lambda a: converted.append(a) or real(a))
    (comm,) = world(1)
    a = fake_cupy.asarray(np.arange(6.0).reshape(2, 3))
    assert_array_equal(host(comm.reduce([a], "sum", root=0)[0]), np.arange(6.0).reshape(2, 3))
    assert_array_equal(host(comm.all_reduce([a], "max")[0]), np.arange(6.0).reshape(2, 3))
    assert converted == []
    comm.all_reduce([fake_cupy.asarray(np.arange(3, dtype=np.int16))], "sum")  # summed as int32: converted
    comm.reduce([np.arange(3.0)], "sum", root=0)  # numpy: copied to the device
    assert len(converted) == 2


def test_reduce_plan_of_outputs_in_one_group(world, fake_cupy, monkeypatch):
    """The kept reduce of a call's outputs (one process): every array in one NCCL group,
    whatever its op; an array given in ``outs`` is reduced in place and stays the result,
    one given as None into a new array; results equal combine's of the one part."""
    (comm,) = world(1)
    counts = _count_exchanges(monkeypatch, comm)
    ends = []
    real_end = fake_cupy.cuda.nccl.groupEnd
    monkeypatch.setattr(fake_cupy.cuda.nccl, "groupEnd", lambda: ends.append(1) or real_end())
    rng = np.random.default_rng(4850)
    kinds = [(d, op) for d in IN_PLACE_DTYPES for op in OPS if _expect_in_place(d, op)]
    for step in range(40):
        picked = [kinds[k] for k in rng.integers(len(kinds), size=rng.integers(1, 5))]
        shapes = [[(), (1,), (7, 3), (5,)][k] for k in rng.integers(4, size=len(picked))]
        layout = tuple((np.dtype(d), s) for (d, _), s in zip(picked, shapes))
        ops = tuple(op for _, op in picked)
        plan = comm.plan("reduce", layout, ops)
        assert plan is not None, (layout, ops)
        vals = [_random_values(rng, 1, d, s)[0] for (d, _), s in zip(picked, shapes)]
        arrays = [fake_cupy.asarray(v) for v in vals]
        write = rng.integers(2, size=len(arrays)).astype(bool)
        outs = [a if w else None for a, w in zip(arrays, write)]
        before, groups = len(fake_cupy.cuda.nccl.calls), len(ends)
        assert plan.run(arrays, outs) is True
        sent = fake_cupy.cuda.nccl.calls[before:]
        assert [c[1] for c in sent] == ["reduce"] * len(arrays) and len(ends) - groups == 1
        for a, o, v, w, op in zip(arrays, outs, vals, write, ops):
            assert (o is a) == bool(w), (w, op)
            want = combine([v.copy()], op)
            assert_array_equal(host(o), want, err_msg=f"{v.dtype} {op}")
            assert_array_equal(host(a), v)  # (one rank: in place or not, the array keeps its values)
    assert counts == {"all_gather": 0, "_publish": 0, "barrier": 0}, counts


def test_reduce_plan_refusals(world, fake_cupy):
    """No kept reduce for what NCCL cannot reduce in the array's own dtype, an empty array,
    a count of ops other than of arrays, or several processes; a kept one sends nothing
    for values of another dtype or shape (the outputs' layout changed), or without ``outs``."""
    (one,) = world(1)
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    lay = ((f32, (3,)), (i32, ()))
    for layout, ops in [(((i32, (3,)),), ("avg",)), (((f32, (0, 2)),), ("sum",)), (lay, ("sum",)),
                        (((np.dtype(np.complex64), (3,)),), ("max",)), (((None, None),), ("sum",))]:
        assert one.plan("reduce", layout, ops) is None, (layout, ops)
    assert one.plan("all_reduce", lay, ("sum", "max")) is None  # (an all-reduce has one op)
    assert world(2)[0].plan("reduce", lay, ("sum", "max")) is None
    plan = one.plan("reduce", lay, ("sum", "max"))
    a, b = fake_cupy.asarray(np.arange(3, dtype=f32)), fake_cupy.asarray(np.array(4, dtype=i32))
    calls = len(fake_cupy.cuda.nccl.calls)
    for values in ([a, fake_cupy.asarray(np.array(4, dtype=np.int64))], [fake_cupy.asarray(np.arange(4, dtype=f32)), b],
                   [a, fake_cupy.asarray(np.array([4], dtype=i32))], [a], [np.arange(3, dtype=f32), b]):
        assert plan.run(values, [None] * len(values)) is False, values
    assert plan.run([a, b]) is False
    assert len(fake_cupy.cuda.nccl.calls) == calls, "a refused run sent something"
    outs = [a, None]
    assert plan.run([a, b], outs) is True and outs[0] is a and outs[1] is not b
