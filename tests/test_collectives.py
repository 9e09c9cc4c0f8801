"""Collectives on shared variables, sliceable shared variables (batch_s) and sliced updates.

Every process holds its own copy of each shared variable a distributed
function uses; these tests move and combine those copies with 1, 2 and 3
processes and check each process's copy with ``get_value``.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import MODE, rows_of
from numpy.testing import assert_allclose, assert_array_equal

import synkhronos as synk
from synkhronos import _runtime as runtime
from synkhronos._batching import split
from synkhronos.collectives import shm

OPS = ("avg", "sum", "prod", "max", "min")
NP_OPS = {
    "avg": lambda parts: np.mean(parts, axis=0),
    "sum": lambda parts: np.sum(parts, axis=0),
    "prod": lambda parts: np.prod(parts, axis=0),
    "max": lambda parts: np.max(parts, axis=0),
    "min": lambda parts: np.min(parts, axis=0),
}


def shared(value, name, dtype=None):
    return pytensor.shared(np.asarray(value, dtype=dtype), name=name)


def use(*shared_vars, distribute=True):
    """A function that reads every variable, so that the workers hold them too."""
    f = synk.function([], [pt.sum(v) for v in shared_vars], mode=MODE)
    if distribute:
        synk.distribute()
    return f


def set_each(var, values) -> None:
    """Give rank r the value ``values[r]``."""
    for rank, value in enumerate(values):
        synk.set_value(rank, var, value)


def values_of(var, n):
    return [synk.get_value(rank, var) for rank in range(n)]


def assert_each(var, expected, n, close=False):
    """Every rank holds ``expected[r]`` (or ``expected`` itself when not a list)."""
    for rank, got in enumerate(values_of(var, n)):
        want = expected[rank] if isinstance(expected, list) else expected
        if close:
            assert_allclose(got, want, rtol=1e-6, err_msg=f"rank {rank} of {n}")
        else:
            assert_array_equal(got, want, err_msg=f"rank {rank} of {n}")


# ---------------------------------------------------------------------------
# broadcast, scatter, gather, all_gather, set_value, get_value, lengths, shapes


def test_broadcast(forked, rng):
    n = forked
    a = shared(np.zeros((3, 2)), "a")
    b = shared(np.zeros(4), "b", dtype="int32")
    use(a, b)
    own = [np.full((3, 2), rank + 1.0) for rank in range(n)]
    set_each(a, own)
    assert_each(a, own, n)

    assert synk.broadcast(a) is None
    assert_each(a, own[0], n)

    new_a, new_b = rng.normal(size=(3, 2)), np.arange(4, dtype="int32")
    assert synk.broadcast([a, b], [new_a, new_b]) is None
    assert_array_equal(a.get_value(), new_a)
    assert_each(a, new_a, n)
    assert_each(b, new_b, n)
    assert all(v.dtype == np.int32 for v in values_of(b, n))

    # a synk.data value of another length; a tuple of one variable
    d = synk.data(np.ones((5, 2)))
    synk.broadcast((a,), (d,))
    assert_each(a, np.ones((5, 2)), n)
    # a nested Python list is one value for one variable
    synk.broadcast(a, [[1.0, 2.0], [3.0, 4.0]])
    assert_each(a, np.array([[1.0, 2.0], [3.0, 4.0]]), n)
    # a list of one 0-d variable takes a list of its one value, a numpy scalar too (no list
    # can be a 0-d value); a list of one 1-d variable still takes a list of scalars whole
    z, v = shared(np.float32(0), "z"), shared(np.zeros(1), "v1")
    use(z, v)
    synk.broadcast([z], [np.float32(2.5)])
    assert_each(z, np.float32(2.5), n)
    synk.set_value(n - 1, [z], [np.float32(3.5)])
    assert_array_equal(synk.get_value(n - 1, z), np.float32(3.5))
    synk.broadcast([v], [7.0])
    assert_each(v, np.array([7.0]), n)


def test_scatter_uneven_and_gather(forked):
    n = forked
    full = np.arange(14.0).reshape(7, 2)
    labels = np.arange(7) * 10
    a = shared(np.zeros((1, 2)), "a")
    b = shared(np.zeros(1), "b", dtype="int64")
    use(a, b)
    assert synk.scatter([a, b], [full, labels]) is None
    assert_each(a, [full[rows_of(7, n, r)] for r in range(n)], n)
    assert_each(b, [labels[rows_of(7, n, r)] for r in range(n)], n)
    assert_array_equal(a.get_value(), full[rows_of(7, n, 0)])

    lengths = [len(range(*split(7, n, r))) for r in range(n)]
    got = synk.get_lengths([a, b])
    assert isinstance(got, tuple) and len(got) == 2
    assert_array_equal(got[0], lengths)
    assert_array_equal(got[1], lengths)
    assert_array_equal(synk.get_lengths(a), lengths)
    assert synk.get_shapes(a) == [(k, 2) for k in lengths]
    assert synk.get_shapes((a, b)) == ([(k, 2) for k in lengths], [(k,) for k in lengths])

    assert_array_equal(synk.gather(a, nd_up=0), full)
    ga, gb = synk.gather([a, b], nd_up=0)
    assert_array_equal(ga, full)
    assert_array_equal(gb, labels)
    if n == 1:
        assert_array_equal(synk.gather(a), full[None])
    else:  # 7 rows never split evenly over 2 or 3
        with pytest.raises(ValueError, match=r"gather\(nd_up=1\) needs equal shapes, but shared "
                                             r"variable 'a' has shapes .*; use nd_up=0"):
            synk.gather(a, nd_up=1)
    # the runtime is fine afterwards
    assert_array_equal(synk.all_gather(a), full)
    # fewer rows than processes: the last ranks get none
    synk.scatter(a, full[:2])
    assert_array_equal(synk.get_lengths(a), [len(range(*split(2, n, r))) for r in range(n)])
    assert_array_equal(synk.gather(a, nd_up=0), full[:2])


def test_scatter_and_set_value_with_batch(forked):
    n = forked
    full = np.arange(30.0).reshape(10, 3)
    a = shared(np.zeros((1, 3)), "a")
    use(a)
    d = synk.data(full)
    for batch, rows in ((6, np.arange(6)), (slice(1, 9, 2), np.arange(1, 9, 2)),
                        ([9, 0, 4, 4, -1], np.array([9, 0, 4, 4, 9])), (None, np.arange(10))):
        picked = full[rows]
        for value in (full, d):
            synk.scatter(a, value, batch=batch)
            assert_each(a, [picked[rows_of(len(rows), n, r)] for r in range(n)], n)
    # set_value with a batch: that rank only
    synk.broadcast(a, np.zeros((2, 3)))
    target = n - 1
    synk.set_value(target, a, d, batch=[3, 1])
    assert_each(a, [full[[3, 1]] if r == target else np.zeros((2, 3)) for r in range(n)], n)
    synk.set_value(0, [a], [full], batch=slice(2, 5))
    assert_array_equal(synk.get_value(0, a), full[2:5])
    assert_array_equal(a.get_value(), full[2:5])


def test_set_value_get_value_lists(forked, rng):
    n = forked
    a = shared(np.zeros(3), "a")
    b = shared(np.zeros((2, 2)), "b", dtype="float32")
    use(a, b)
    va = [rng.normal(size=3 + r) for r in range(n)]
    vb = [rng.normal(size=(2, 2)).astype("float32") for _ in range(n)]
    for r in range(n):
        assert synk.set_value(r, (a, b), (va[r], synk.data(vb[r]))) is None
    for r in range(n):
        got = synk.get_value(r, [a, b])
        assert isinstance(got, tuple) and len(got) == 2
        assert_array_equal(got[0], va[r])
        assert_array_equal(got[1], vb[r])
        assert got[1].dtype == np.float32
    assert_array_equal(a.get_value(), va[0])
    # get_value returns copies: changing them changes nothing in the processes
    synk.get_value(n - 1, a)[:] = -1
    assert_array_equal(synk.get_value(n - 1, a), va[n - 1])
    # as with PyTensor's own set_value: a float64 array is refused by a float32
    # variable (it could lose precision), a Python list of floats is taken
    with pytest.raises(TypeError, match="float32"):
        synk.set_value(n - 1, b, np.ones((2, 2)))
    synk.set_value(n - 1, b, [[1.0, 2.0], [3.0, 4.0]])
    assert synk.get_value(n - 1, b).dtype == np.float32


def test_gather_and_all_gather(forked):
    n = forked
    a = shared(np.zeros((2, 3)), "a")
    c = shared(np.float64(0), "c")
    use(a, c)
    own = [np.arange(6.0).reshape(2, 3) + 10 * r for r in range(n)]
    set_each(a, own)
    set_each(c, [float(r) for r in range(n)])

    assert_array_equal(synk.gather(a), np.stack(own))
    assert_array_equal(synk.gather(a, nd_up=0), np.concatenate(own))
    ga, gc = synk.gather([a, c])
    assert_array_equal(ga, np.stack(own))
    assert_array_equal(gc, np.arange(n, dtype=float))
    with pytest.raises(ValueError, match=r"gather\(nd_up=0\) cannot concatenate 0-d shared variable 'c'"):
        synk.gather(c, nd_up=0)
    with pytest.raises(ValueError, match=r"nd_up must be 0 \(concatenate\) or 1 \(stack\), got 2"):
        synk.gather(a, nd_up=2)
    with pytest.raises(ValueError, match=r"all_gather cannot store .* 0-d shared variable 'c'"):
        synk.all_gather([a, c])

    joined = synk.all_gather(a)
    assert_array_equal(joined, np.concatenate(own))
    assert_each(a, np.concatenate(own), n)
    # all_gather with uneven lengths, a tuple of one variable
    set_each(a, [np.full((r + 1, 3), float(r)) for r in range(n)])
    (joined,) = synk.all_gather((a,))
    want = np.concatenate([np.full((r + 1, 3), float(r)) for r in range(n)])
    assert_array_equal(joined, want)
    assert_each(a, want, n)
    assert_array_equal(synk.get_lengths(a), [len(want)] * n)


# ---------------------------------------------------------------------------
# reduce and all_reduce, every op


def _fresh(n, rng, shape=(3, 4)):
    return [rng.uniform(0.5, 2.0, size=shape) for _ in range(n)]


def test_reduce_every_op(forked, rng):
    n = forked
    a = shared(np.zeros((3, 4)), "a")
    k = shared(np.zeros(5), "k", dtype="int32")
    use(a, k)
    for op in OPS:
        own = _fresh(n, rng)
        want = NP_OPS[op](own)

        # not in place: the result comes back, no process changes
        set_each(a, own)
        got = synk.reduce(a, op=op, in_place=False)
        assert isinstance(got, np.ndarray)
        assert_allclose(got, want, err_msg=op)
        assert_array_equal(a.get_value(), own[0])
        assert_each(a, own, n)

        # in place: the master's copy changes, the workers' do not
        assert synk.reduce(a, op=op) is None
        assert_allclose(a.get_value(), want, err_msg=op)
        assert_each(a, [want] + own[1:], n, close=True)

    # a list of variables returns a tuple; int dtypes stay int
    ints = [np.arange(5, dtype="int32") * (r + 1) - 3 for r in range(n)]
    set_each(k, ints)
    set_each(a, _fresh(n, rng))
    for op in ("sum", "max", "min", "prod"):
        ga, gk = synk.reduce([a, k], op="c_" + op if op == "sum" else op, in_place=False)
        assert_allclose(ga, NP_OPS[op](values_of(a, n)))
        assert_array_equal(gk, NP_OPS[op](ints))
        assert gk.dtype == np.int32
    assert isinstance(synk.reduce((a,), op="sum", in_place=False), tuple)


def test_all_reduce_every_op(forked, rng):
    n = forked
    a = shared(np.zeros((3, 4)), "a", dtype="float32")
    b = shared(np.zeros(2), "b")
    use(a, b)
    for op in OPS:
        own_a = [x.astype("float32") for x in _fresh(n, rng)]
        own_b = _fresh(n, rng, shape=(2,))
        set_each(a, own_a)
        set_each(b, own_b)
        assert synk.all_reduce([a, b], op=op) is None
        assert_each(a, NP_OPS[op](own_a), n, close=True)
        assert_each(b, NP_OPS[op](own_b), n, close=True)
        assert all(v.dtype == np.float32 for v in values_of(a, n))
    # default op is avg; one variable
    set_each(b, [np.full(2, float(r)) for r in range(n)])
    synk.all_reduce(b)
    assert_each(b, np.full(2, (n - 1) / 2), n, close=True)


def test_reduce_with_master_rank_1(fork):
    """The master need not be rank 0: rank order stays rank order."""
    n = fork(2, master_rank=1)
    a = shared(np.zeros(2), "a")
    use(a)
    set_each(a, [np.array([3.0, 3.0]), np.array([7.0, 7.0])])
    assert_array_equal(a.get_value(), [7.0, 7.0])
    assert_array_equal(synk.gather(a), [[3.0, 3.0], [7.0, 7.0]])
    synk.reduce(a, op="sum")
    assert_each(a, [np.array([3.0, 3.0]), np.array([10.0, 10.0])], n)
    synk.scatter(a, np.arange(5.0))
    assert_each(a, [np.arange(3.0), np.arange(3.0, 5.0)], n)
    synk.broadcast(a)
    assert_each(a, np.arange(3.0, 5.0), n)


@pytest.mark.parametrize("n", [2, 3])
def test_large_reduce_and_all_reduce_chunked(fork, rng, n):
    """A few MiB per variable: every process reduces its own chunk (CHUNK_THRESHOLD)."""
    fork(n)
    a = shared(np.zeros((257, 1023)), "a")                    # ~2 MiB, odd element count
    b = shared(np.zeros((129, 1025)), "b", dtype="float32")   # ~0.5 MiB
    assert 257 * 1023 * 8 > shm.CHUNK_THRESHOLD
    assert 129 * 1025 * 4 > shm.CHUNK_THRESHOLD
    use(a, b)
    own_a = [rng.uniform(0.5, 1.5, size=(257, 1023)) for _ in range(n)]
    own_b = [rng.uniform(0.5, 1.5, size=(129, 1025)).astype("float32") for _ in range(n)]
    comm = runtime.running_session().proc.comm
    for op in OPS:
        set_each(a, own_a)
        set_each(b, own_b)
        ga, gb = synk.reduce([a, b], op=op, in_place=False)
        assert comm._result is not None, "the chunked path was not taken"
        assert_allclose(ga, NP_OPS[op](own_a), rtol=1e-12, err_msg=op)
        assert_allclose(gb, NP_OPS[op](own_b), rtol=1e-5, err_msg=op)
        assert_array_equal(a.get_value(), own_a[0])

        synk.reduce(a, op=op)
        assert_allclose(a.get_value(), NP_OPS[op](own_a), rtol=1e-12, err_msg=op)
        assert_array_equal(synk.get_value(n - 1, a), own_a[n - 1])

        set_each(a, own_a)
        synk.all_reduce([a, b], op=op)
        assert_each(a, NP_OPS[op](own_a), n, close=True)
        for got in values_of(b, n):
            assert_allclose(got, NP_OPS[op](own_b), rtol=1e-5, err_msg=op)


# ---------------------------------------------------------------------------
# sliceable shared variables and batch_s


def _batch_s_forms(n):
    """(name, batch_s, the rows it selects in rank r's copy), rank r holding 5 + r rows."""
    per_rank = [[slice(0, 2), [4, 1, 3, 1], None][r % 3] for r in range(n)]
    return [
        ("slice for all", slice(1, 4), lambda r: np.arange(1, 4)),
        # -1 is the last row of each process's own copy
        ("index list for all", [3, 0, 0, -1], lambda r: np.array([3, 0, 0, 4 + r])),
        ("one per process", per_rank,
         lambda r: [np.arange(2), np.array([4, 1, 3, 1]), np.arange(5 + r)][r % 3]),
        ("no batch_s", None, lambda r: np.arange(5 + r)),
    ]


def test_batch_s_three_forms_and_num_slices(forked, rng):
    n = forked
    w = shared(np.zeros((1, 2)), "w")
    f = synk.function([], [(w.mean(axis=0), "avg"), (w.sum(axis=0), "sum"), (w.max(axis=0), "max"),
                           (w.shape[0], "sum")],
                      sliceable_shareds=[w], mode=MODE)
    synk.distribute()
    own = [rng.normal(size=(5 + r, 2)) for r in range(n)]   # rank r holds 5 + r rows
    set_each(w, own)
    for form, batch_s, rows in _batch_s_forms(n):
        picked = np.concatenate([own[r][rows(r)] for r in range(n)])
        for num_slices in (1, 2, 3):
            mean, total, top, count = f(batch_s=batch_s, num_slices=num_slices)
            label = f"{form}, num_slices={num_slices}"
            # avg is weighted by the rows each process used (all of them without batch_s)
            assert_allclose(mean, picked.mean(axis=0), err_msg=label)
            assert_allclose(total, picked.sum(axis=0), err_msg=label)
            assert_array_equal(top, picked.max(axis=0), err_msg=label)
            assert count == len(picked), label
    # batch_s never changes the processes' copies
    assert_each(w, own, n)


def test_batch_s_with_scattered_inputs(forked, rng):
    n = forked
    w = shared(np.zeros((1, 3)), "w")
    x = pt.dmatrix("x")
    f = synk.function([x], [((x * w).sum(axis=1).mean(), "avg"), ((x * w).sum(), "sum")],
                      sliceable_shareds=[w], mode=MODE)
    own = [rng.normal(size=(9, 3)) for _ in range(n)]
    set_each(w, own)
    x_dat = rng.normal(size=(8, 3))
    # each process selects as many rows of w as it gets rows of x
    batch_s = []
    for r in range(n):
        k = len(range(*split(8, n, r)))
        batch_s.append(np.arange(k)[::-1] + (r % 2))
    prods = np.concatenate([(x_dat[rows_of(8, n, r)] * own[r][batch_s[r]]).sum(axis=1)
                            for r in range(n)])
    for num_slices in (1, 2):
        mean, total = f(x_dat, batch_s=batch_s, num_slices=num_slices)
        assert_allclose(mean, prods.mean())
        assert_allclose(total, prods.sum())
    # uneven batch of the scattered input: the selection must follow it
    with pytest.raises(ValueError, match=r"rank 0: batch_s selects \d+ rows of the sliceable shared "
                                         r"variables but this process has \d+ rows of scattered inputs"):
        f(x_dat, batch_s=[np.arange(7)] * n)
    mean, _ = f(x_dat, batch_s=batch_s)   # usable afterwards
    assert_allclose(mean, prods.mean())


# ---------------------------------------------------------------------------
# updates (var, expr, op) over num_slices


def _expected_update(op, s0, x_rows, num_slices):
    """Each slice computes 2 * s0 + sum of its rows from the original s0; combine with op."""
    parts, weights = [], []
    for k in range(num_slices):
        lo, hi = split(len(x_rows), num_slices, k)
        if hi > lo:
            parts.append(2 * s0 + x_rows[lo:hi].sum(axis=0))
            weights.append(hi - lo)
    if op == "avg":
        return np.average(parts, axis=0, weights=weights)
    return NP_OPS[op](parts)


def test_updates_accumulate_over_num_slices(forked, rng):
    n = forked
    x = pt.dmatrix("x")
    svars = {op: shared(np.zeros(2), f"s_{op}") for op in OPS}
    plain = shared(np.zeros(2), "s_plain")
    updates = [(svars[op], 2 * svars[op] + x.sum(axis=0), op) for op in OPS]
    updates.append((plain, 2 * plain + x.sum(axis=0)))   # default op: avg
    f = synk.function([x], (x.mean(axis=0), "avg"), updates=updates, mode=MODE)
    assert f.update_modes == list(OPS) + ["avg"]
    synk.distribute()
    x_dat = rng.integers(1, 5, size=(11, 2)).astype(float)
    s0 = np.array([1.0, 0.5])
    all_vars = list(svars.values()) + [plain]
    for num_slices in (1, 2, 3):
        synk.broadcast(all_vars, [s0] * len(all_vars))
        out = f(x_dat, num_slices=num_slices)
        assert_allclose(out, x_dat.mean(axis=0))
        for op, var in list(svars.items()) + [("avg", plain)]:
            want = [_expected_update(op, s0, x_dat[rows_of(11, n, r)], num_slices) for r in range(n)]
            for r, got in enumerate(values_of(var, n)):
                assert_allclose(got, want[r], err_msg=f"{var.name}, num_slices={num_slices}, rank {r}")
    # the updates are local: nothing was reduced
    if n > 1:
        assert not np.allclose(synk.get_value(0, plain), synk.get_value(1, plain))


# ---------------------------------------------------------------------------
# errors


def test_variable_used_by_no_distributed_function(forked):
    n = forked
    a = shared(np.zeros(3), "a")
    lonely = shared(np.zeros(3), "lonely")
    use(a)
    msg = r"shared variable 'lonely' is used by no distributed synkhronos function"
    calls = [
        lambda v: synk.broadcast(v), lambda v: synk.scatter(v, np.zeros(3)),
        lambda v: synk.gather(v), lambda v: synk.all_gather(v), lambda v: synk.reduce(v),
        lambda v: synk.all_reduce(v), lambda v: synk.set_value(0, v, np.zeros(3)),
        lambda v: synk.get_value(0, v), lambda v: synk.get_lengths(v), lambda v: synk.get_shapes(v),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=msg):
            call(lonely)
        with pytest.raises(ValueError, match=msg):
            call([a, lonely])
    with pytest.raises(TypeError, match="expected PyTensor shared variables"):
        synk.gather(np.zeros(3))
    with pytest.raises(ValueError, match="no shared variables given"):
        synk.gather([])
    # a function built later is distributed by the collective itself
    use(lonely, distribute=False)
    synk.set_value(n - 1, lonely, np.ones(3))
    assert_array_equal(synk.gather(lonely, nd_up=0)[-3:], np.ones(3))


def test_rank_counts_and_ops_errors(forked):
    n = forked
    a = shared(np.zeros(3), "a")
    b = shared(np.zeros(3), "b")
    use(a, b)
    for rank in (n, -1):
        with pytest.raises(ValueError, match=rf"rank {rank} is out of range: the fork has ranks 0\.\.{n - 1}"):
            synk.get_value(rank, a)
        with pytest.raises(ValueError, match=rf"rank {rank} is out of range"):
            synk.set_value(rank, a, np.ones(3))
    with pytest.raises(TypeError, match=r"rank must be an int, got '0'"):
        synk.get_value("0", a)

    with pytest.raises(ValueError, match=r"broadcast: 1 values for 2 shared variables"):
        synk.broadcast([a, b], [np.ones(3)])
    with pytest.raises(ValueError, match=r"scatter: 3 values for 2 shared variables"):
        synk.scatter([a, b], [np.ones(3)] * 3)
    with pytest.raises(ValueError, match=r"set_value: 1 values for 2 shared variables"):
        synk.set_value(0, (a, b), (np.ones(3),))
    with pytest.raises(ValueError, match=r"unknown op 'mean'; expected one of"):
        synk.reduce(a, op="mean")
    with pytest.raises(ValueError, match=r"unknown op 'gather'"):
        synk.all_reduce(a, op="gather")
    with pytest.raises(IndexError, match=r"batch slice .* is out of range for inputs of 3 rows"):
        synk.scatter(a, np.ones(3), batch=slice(0, 9))
    # nothing changed, and the runtime is usable
    assert_each(a, np.zeros(3), n)
    if n > 1:
        synk.set_value(n - 1, a, np.zeros(4))
        for call in (lambda: synk.reduce(a, op="sum"), lambda: synk.all_reduce(a, op="max")):
            with pytest.raises(ValueError, match=rf"cannot (sum|max)-reduce: rank 0 holds \[\('float64', "
                                                 rf"\(3,\)\)\] but rank {n - 1} holds \[\('float64', \(4,\)\)\]"):
                call()
        synk.set_value(n - 1, a, np.ones(3))
        assert_array_equal(synk.reduce(a, op="sum", in_place=False), np.ones(3))


def test_batch_s_errors(forked):
    n = forked
    w = shared(np.zeros((1, 2)), "w")
    plain = shared(np.zeros(2), "plain")
    f = synk.function([], (w.sum(axis=0), "sum"), sliceable_shareds=[w], mode=MODE)
    g = synk.function([], plain.sum(), mode=MODE)
    set_each(w, [np.ones((4 - (r > 0), 2)) for r in range(n)])   # rank 0: 4 rows, others 3
    with pytest.raises(TypeError, match=r"has no sliceable shared variables; batch_s must be None"):
        g(batch_s=slice(0, 1))
    with pytest.raises(ValueError, match=rf"batch_s has {n + 1} entries, one per process expected \({n}\)"):
        f(batch_s=[slice(0, 1)] * (n + 1))
    with pytest.raises(IndexError, match=r"rank 0: batch_s is beyond this process's rows of the "
                                         r"sliceable shared variables: batch index 7"):
        f(batch_s=[0, 7])
    if n > 1:
        # rows 0..3 exist in the master but not in the workers: the worker's error reaches the master
        with pytest.raises(IndexError, match=r"rank 1: batch_s is beyond this process's rows") as err:
            f(batch_s=slice(0, 4))
        assert getattr(err.value, "synk_rank", None) == 1
        with pytest.raises(IndexError, match=rf"rank {n - 1}: batch_s is beyond"):
            f(batch_s=[slice(0, 1)] * (n - 1) + [[3]])
    # usable afterwards
    assert_array_equal(f(batch_s=slice(0, 3)), np.full(2, 3.0 * n))
