"""synk.function on 1, 2 and 3 processes: output ops, splits, batches, slices, updates."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_allclose, assert_array_equal

import synkhronos as synk
from conftest import MODE, rows_of

# ---------------------------------------------------------------------------
# output ops


def _all_ops_function():
    x = pt.dmatrix("x")
    outputs = [
        (x.mean(axis=0), "avg"),
        (x.sum(), "sum"),
        (x.prod(), "prod"),
        (x.max(axis=0), "max"),
        (x.min(), "min"),
        (x * 2.0, "gather"),
        (x.sum(axis=0), None),
        (x.mean(), "c_avg"),
        (x.sum(axis=0), "c_sum"),
        (x.max(), "c_max"),
    ]
    return synk.function([x], outputs, mode=MODE), x


def test_output_ops_equal_whole_batch(forked):
    f, _ = _all_ops_function()
    assert f.output_modes[:7] == ["avg", "sum", "prod", "max", "min", "gather", None]
    a = np.random.default_rng(0).uniform(0.5, 1.5, size=(6, 3))
    got = f(a)
    ref = f.as_pytensor(a)
    assert isinstance(got, list) and len(got) == 10
    mine = rows_of(6, forked, 0)
    numpy_ref = [a.mean(0), a.sum(), a.prod(), a.max(0), a.min(), a * 2, a[mine].sum(0),
                 a.mean(), a.sum(0), a.max()]
    for i, (g, r, n) in enumerate(zip(got, ref, numpy_ref)):
        assert np.shape(g) == np.shape(n), f"output {i}"
        assert_allclose(g, n, rtol=1e-12, err_msg=f"output {i} ({f.output_modes[i]}) vs numpy")
        if i != 6:  # op None is the master's share only
            assert_allclose(g, r, rtol=1e-12, err_msg=f"output {i} vs as_pytensor")
    if forked > 1:  # the master's own share differs from the whole batch
        assert not np.allclose(got[6], ref[6])


def test_reduce_ops_keyword(forked):
    x = pt.dmatrix("x")
    f_one = synk.function([x], [x.sum(), x.max()], reduce_ops="sum", mode=MODE)
    f_each = synk.function([x], [x.sum(), x.max()], reduce_ops=["sum", "max"], mode=MODE)
    assert f_one.output_modes == ["sum", "sum"]
    assert f_each.output_modes == ["sum", "max"]
    a = np.arange(12.0).reshape(6, 2)
    s, m = f_one(a)
    assert s == a.sum()
    # each process contributes its own max: their sum
    assert m == sum(a[rows_of(6, forked, r)].max() for r in range(forked))
    assert_allclose(f_each(a), [a.sum(), a.max()])


def test_integer_outputs_keep_dtype(forked):
    x = pt.lmatrix("x")
    f = synk.function([x], [(x.sum(), "sum"), (x, "gather"), (x.max(), "max")], mode=MODE)
    a = np.arange(18, dtype=np.int64).reshape(9, 2)
    s, g, m = f(a)
    assert s.dtype == np.int64 and s == a.sum()
    assert g.dtype == np.int64
    assert_array_equal(g, a)
    assert m == 17


@pytest.mark.parametrize("n,rows", [(2, 7), (3, 7), (3, 1), (3, 2), (2, 1), (3, 4)])
def test_uneven_splits(fork, n, rows):
    fork(n)
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.mean(axis=0), "avg"), (x.mean(), "avg"), (x, "gather"),
                            (x.max(axis=0), "max"), (x.sum(), "sum"), (x.min(), "min")],
                      mode=MODE)
    a = np.random.default_rng(rows).normal(size=(rows, 3))
    mean0, mean, gathered, mx, total, mn = f(a)
    ref = f.as_pytensor(a)
    # avg weights each process by its rows: exactly the single-process mean
    assert_allclose(mean0, a.mean(axis=0), rtol=1e-12)
    assert_allclose(mean, a.mean(), rtol=1e-12)
    assert_allclose(mean0, ref[0], rtol=1e-12)
    assert_array_equal(gathered, a)
    assert_array_equal(mx, a.max(axis=0))
    assert_allclose(total, a.sum(), rtol=1e-12)
    assert mn == a.min()


def test_master_rank_other_than_zero(fork):
    fork(3, master_rank=1)
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.mean(axis=0), "avg"), (x, "gather"), (x.sum(), None)], mode=MODE)
    a = np.arange(14.0).reshape(7, 2)
    mean, gathered, own = f(a)
    assert_allclose(mean, a.mean(axis=0))
    assert_array_equal(gathered, a)  # rank order, not master first
    assert own == a[rows_of(7, 3, 1)].sum()


# ---------------------------------------------------------------------------
# batch selection


BATCHES = {
    "int": 5,
    "np_int": np.int64(3),
    "slice": slice(1, 9),
    "slice_step": slice(1, 10, 3),
    "slice_negative": slice(-6, -1, 2),
    "list": [7, 0, 3, 3, 9],
    "np_array": np.array([8, 2, 5, 1, 6, 0], dtype=np.int32),
    "negative_idx": [-1, -10, 4, -3],
    "single": [6],
}


def _selected(batch, n):
    if isinstance(batch, (int, np.integer)):
        return np.arange(int(batch))
    return np.arange(n)[batch]


@pytest.mark.parametrize("kind", list(BATCHES))
def test_batch_kinds(forked, kind):
    batch = BATCHES[kind]
    x = pt.dmatrix("x")
    y = pt.lvector("y")
    f = synk.function([x, y], [(x, "gather"), (x.mean(axis=0), "avg"), (y, "gather"),
                               (y.sum(), "sum")], mode=MODE)
    a = np.arange(30.0).reshape(10, 3) ** 1.5
    b = np.arange(10, dtype=np.int64) * 7
    sel = _selected(batch, 10)
    expected = [a[sel], a[sel].mean(axis=0), b[sel], b[sel].sum()]
    da, db = synk.data(a), synk.data(b)
    for label, args in (("numpy", (a, b)), ("synk.data", (da, db)), ("mixed", (da, b))):
        got = f(*args, batch=batch)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_allclose(g, e, rtol=1e-12, err_msg=f"{label} inputs, output {i}")
    # the batch did not touch the inputs themselves
    assert_array_equal(da.data, a)


def test_minibatch_data(forked):
    x = pt.dmatrix("x")
    m = pt.dmatrix("m")
    f = synk.function([x, m], [(x, "gather"), (m, "gather"), ((x * m).sum(), "sum")], mode=MODE)
    g = synk.function([m], (m, "gather"), mode=MODE)
    a = np.arange(20.0).reshape(10, 2)
    batch = [9, 4, 0, 7]
    # a minibatch holds exactly the rows of one batch: row i goes with batch[i]
    mb = synk.data(a[batch] + 100, minibatch=True)
    assert mb.minibatch
    gx, gm, dot = f(a, mb, batch=batch)
    assert_array_equal(gx, a[batch])
    assert_array_equal(gm, a[batch] + 100)
    assert_allclose(dot, (a[batch] * (a[batch] + 100)).sum())
    # longer minibatch data: its first rows are used, in order
    big = synk.data(np.arange(12.0).reshape(6, 2), minibatch=True)
    assert_array_equal(g(big, batch=3), big.data[:3])
    assert_array_equal(g(big), big.data)
    # its length does not have to match the other inputs without a batch either
    gx, gm, _ = f(synk.data(a[:4]), big)
    assert_array_equal(gm, big.data[:4])
    assert_array_equal(gx, a[:4])


# ---------------------------------------------------------------------------
# num_slices


def test_num_slices_outputs(forked):
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.sum(), "sum"), (x.mean(axis=0), "avg"), (x, "gather"),
                            (x.max(), "max"), (x.min(axis=0), "min")], mode=MODE)
    a = np.random.default_rng(5).normal(size=(13, 2))
    whole = f(a)
    for k in (2, 3, 7, 20):  # 20: more slices than rows, empty slices are skipped
        got = f(a, num_slices=k)
        for i, (g, w) in enumerate(zip(got, whole)):
            assert_allclose(g, w, rtol=1e-12, err_msg=f"num_slices={k}, output {i}")
    assert_allclose(whole[1], a.mean(axis=0))


def test_num_slices_update_ops(forked):
    """Each slice computes the update from the original value; the op accumulates them."""
    n = forked
    x = pt.dmatrix("x")
    s_sum = pytensor.shared(np.float64(1.0), name="s_sum")
    s_avg = pytensor.shared(np.float64(1.0), name="s_avg")
    s_max = pytensor.shared(np.float64(0.0), name="s_max")
    f = synk.function([x], (x.sum(), "sum"),
                      updates=[(s_sum, s_sum + x.sum(), "sum"), (s_avg, s_avg + x.sum()),
                               (s_max, s_max + x.sum(), "max")], mode=MODE)
    assert f.update_modes == ["sum", "avg", "max"]
    peek = synk.function([], [(s_sum, "gather"), (s_avg, "gather"), (s_max, "gather")], mode=MODE)
    a = np.arange(12.0).reshape(12, 1) + 1  # 12, 6 or 4 rows per process: two equal slices
    assert f(a, num_slices=2) == a.sum()
    sums, avgs, maxes = peek()
    for r in range(n):
        mine = a[rows_of(12, n, r)]
        halves = [mine[: len(mine) // 2].sum(), mine[len(mine) // 2:].sum()]
        assert sums[r] == pytest.approx(2 * 1.0 + mine.sum()), f"rank {r}: sum over slices"
        assert avgs[r] == pytest.approx(1.0 + mine.sum() / 2), f"rank {r}: avg over slices"
        assert maxes[r] == pytest.approx(max(halves)), f"rank {r}: max over slices"
    assert s_sum.get_value() == sums[0]  # the master's own copy
    # one slice applies the update once
    s_sum.set_value(np.float64(0.0))
    f(a)
    assert s_sum.get_value() == a[rows_of(12, n, 0)].sum()


# ---------------------------------------------------------------------------
# calling conventions


def test_output_subset(forked):
    x = pt.dmatrix("x")
    count = pytensor.shared(np.float64(0.0), name="count")
    f = synk.function([x], [(x.sum(), "sum"), (x, "gather"), (x.max(), "max")],
                      updates=[(count, count + 1)], mode=MODE)
    a = np.arange(10.0).reshape(5, 2)
    got = f(a, output_subset=[2, 0])
    assert isinstance(got, list) and len(got) == 2
    assert got[0] == 9.0 and got[1] == a.sum()
    only = f(a, output_subset=[1])
    assert isinstance(only, list) and len(only) == 1
    assert_array_equal(only[0], a)
    assert_array_equal(f(a, output_subset=(1,))[0], a)
    # updates still run with a subset
    assert count.get_value() == 3.0


def test_inputs_by_name(forked):
    x = pt.dmatrix("x")
    w = pt.dvector("w")
    f = synk.function([x, w], [((x * w[:, None]).sum(), "sum"), (x - w[:, None], "gather")],
                      mode=MODE)
    a = np.arange(12.0).reshape(6, 2)
    wv = np.arange(6.0) + 1
    ref = f(a, wv)
    assert ref[0] == pytest.approx((a * wv[:, None]).sum())
    assert_array_equal(ref[1], a - wv[:, None])
    for got in (f(x=a, w=wv), f(w=wv, x=a), f(a, w=wv)):
        assert got[0] == pytest.approx(ref[0])
        assert_array_equal(got[1], ref[1])
    # by name with synk.data and a batch
    got = f(w=synk.data(wv), x=synk.data(a), batch=[5, 1])
    assert_array_equal(got[1], (a - wv[:, None])[[5, 1]])


@pytest.mark.parametrize("by", ["variable", "position"])
def test_broadcast_inputs(forked, by):
    n = forked
    x = pt.dmatrix("x")
    w = pt.dmatrix("w")
    c = pt.dscalar("c")
    bcast = [w, c] if by == "variable" else [1, 2]
    f = synk.function([x, w, c], [(pt.dot(x, w) * c, "gather"), (w.sum() + c, "sum"),
                                  (w.shape[0], "sum")], bcast_inputs=bcast, mode=MODE)
    a = np.arange(14.0).reshape(7, 2)
    wv = np.arange(6.0).reshape(2, 3)
    gathered, wsum, wrows = f(a, wv, 2.0)
    assert_allclose(gathered, a @ wv * 2.0)
    # every process got w and c whole
    assert wsum == pytest.approx(n * (wv.sum() + 2.0))
    assert wrows == n * 2
    # broadcast inputs as synk.data, and a broadcast input longer than the scattered ones
    dw = synk.data(np.ones((2, 40)))
    got = f(synk.data(a), dw, np.float64(0.5), output_subset=[0, 2])
    assert_allclose(got[0], a @ np.ones((2, 40)) * 0.5)
    assert got[1] == n * 2


def test_only_broadcast_inputs(forked):
    n = forked
    w = pt.dvector("w")
    f = synk.function([w], [(w.sum(), "avg"), (w.sum(), "sum"), (w * 1.0, "gather")],
                      bcast_inputs=[w], mode=MODE)
    v = np.arange(4.0)
    avg, total, gathered = f(v)
    assert avg == v.sum()
    assert total == n * v.sum()
    assert_array_equal(gathered, np.tile(v, n))


def test_return_conventions(forked):
    x = pt.dmatrix("x")
    a = np.arange(6.0).reshape(3, 2)
    single = synk.function([x], x.sum(), mode=MODE)
    pair = synk.function([x], (x.sum(), "sum"), mode=MODE)
    listed = synk.function([x], [x.sum()], mode=MODE)
    pairs = synk.function([x], [(x.sum(), "sum"), (x.max(), "max")], mode=MODE)
    s = pytensor.shared(np.float64(0.0), name="acc")
    nothing = synk.function([x], updates=[(s, s + x.sum())], mode=MODE)
    r = single(a)
    assert isinstance(r, np.ndarray) and r.ndim == 0
    r = pair(a)
    assert isinstance(r, np.ndarray) and r == a.sum()
    r = listed(a)
    assert isinstance(r, list) and len(r) == 1
    r = pairs(a)
    assert isinstance(r, list) and r == [a.sum(), a.max()]
    assert nothing(a) == []
    assert nothing.as_pytensor(a) == []
    assert isinstance(single.as_pytensor(a), np.ndarray)
    assert isinstance(listed.as_pytensor(a), list)


def test_function_attributes_and_build_inputs(forked):
    x = pt.dmatrix("x")
    y = pt.dvector("y")
    f = synk.function([x, y], [(x.sum() + y.sum(), "sum")], mode=MODE, name="my_fn")
    g = synk.function([x], x.sum(), mode=MODE)
    assert f.name == "my_fn"
    assert g.name.startswith("synk_function_") and g.name != f.name
    assert "my_fn" in repr(f)
    a, b = np.arange(8.0).reshape(4, 2), np.arange(4.0)
    assert_allclose(f.as_theano(a, b), f.as_pytensor(a, b))
    assert f.as_pytensor(a, b)[0] == a.sum() + b.sum()
    da, db = f.build_inputs(a, b)
    assert isinstance(da, synk.Data) and isinstance(db, synk.Data)
    assert (da.name, db.name) == ("x", "y")
    assert_array_equal(da.data, a)
    assert f(da, db) == f(a, b) == [a.sum() + b.sum()]
    single = g.build_inputs(a)
    assert isinstance(single, synk.Data)


# ---------------------------------------------------------------------------
# distribute


def test_function_built_after_distribute(forked):
    from synkhronos import _runtime as runtime

    x = pt.dmatrix("x")
    f1 = synk.function([x], (x.sum(), "sum"), mode=MODE)
    synk.distribute()
    synk.distribute()  # nothing new: a no-op
    sess = runtime.running_session()
    assert f1._spec.fid in sess.distributed
    f2 = synk.function([x], (x * 3.0, "gather"), mode=MODE)
    assert f2._spec.fid not in sess.distributed
    a = np.arange(10.0).reshape(5, 2)
    assert_array_equal(f2(a), a * 3.0)  # distributed on its first call
    assert f2._spec.fid in sess.distributed
    f3 = synk.function([x], (x.max(), "max"), mode=MODE)
    synk.distribute()
    assert f3._spec.fid in sess.distributed
    assert f1(a) == a.sum()
    assert f3(a) == 9.0
    assert_array_equal(f2(a), a * 3.0)


# ---------------------------------------------------------------------------
# updates and shared variables


def test_local_updates_worked_example(fork):
    """The documented example: each process updates its own copy from its own rows."""
    fork(2)
    s = pytensor.shared(np.array([1.0, 1.0]), name="s")
    x = pt.dmatrix("x")
    f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))], mode=MODE)
    peek = synk.function([], (s, "gather"), mode=MODE)
    synk.distribute()
    assert f(np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])) == []
    assert_array_equal(s.get_value(), [3.0, 3.0])       # master (rank 0): rows 1 and 2
    assert_array_equal(peek(), [3.0, 3.0, 7.0, 7.0])    # worker (rank 1): rows 3 and 4


def test_shared_variable_identity_across_functions(forked):
    n = forked
    s = pytensor.shared(np.zeros(2), name="s")
    x = pt.dmatrix("x")
    bump = synk.function([x], updates=[(s, s + x.sum(axis=0))], mode=MODE)
    show = synk.function([], [(s, "gather"), (s * 1.0, None), (s, "sum")], mode=MODE)
    # the workers start from the master's value at distribute time
    s.set_value(np.array([10.0, 20.0]))
    synk.distribute()
    # a function built later refers to the same variable in every process
    late = synk.function([], (s + 0.0, "gather"), mode=MODE)
    a = np.arange(12.0).reshape(6, 2)
    bump(a)
    per_rank = [np.array([10.0, 20.0]) + a[rows_of(6, n, r)].sum(axis=0) for r in range(n)]
    gathered, own, total = show()
    assert_array_equal(gathered, np.concatenate(per_rank))
    assert_array_equal(own, per_rank[0])
    assert_array_equal(s.get_value(), per_rank[0])
    assert_allclose(total, np.sum(per_rank, axis=0))
    assert_array_equal(late(), np.concatenate(per_rank))
    bump(a)
    assert_array_equal(late(), np.concatenate([p + a[rows_of(6, n, r)].sum(axis=0)
                                               for r, p in enumerate(per_rank)]))
