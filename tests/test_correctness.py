"""Never a silent wrong answer: integer averages, casts, num_slices, duplicates, nesting.

Each test here failed before its fix (issue: "never a silent wrong answer").
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import MODE, rows_of
from numpy.testing import assert_allclose, assert_array_equal
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos._batching import split
from synkhronos.collectives import shm

#: Elements of an int64/float64 array that take the chunked (large) path.
LARGE = shm.CHUNK_THRESHOLD // 8 + 5


def use(*shared_vars):
    f = synk.function([], [pt.sum(v) for v in shared_vars], mode=MODE)
    synk.distribute()
    return f


def set_each(var, values):
    for rank, value in enumerate(values):
        synk.set_value(rank, var, value)


def expected_avg_into(dtype, parts, weights=None):
    """What an in-place avg into a variable of ``dtype`` must hold: rounded, not truncated."""
    mean = np.average(np.asarray(parts, dtype=np.float64), axis=0, weights=weights)
    if np.dtype(dtype).kind in "biu":
        return np.rint(mean).astype(dtype)
    return mean.astype(dtype)


# ---------------------------------------------------------------------------
# 1. avg of integers


def test_int_avg_all_reduce_rounds_the_issue_example(fork):
    fork(3)
    s = pytensor.shared(np.array([7, 14, 25], dtype=np.int64), name="s")
    use(s)
    synk.all_reduce(s, "avg")
    for rank in range(3):
        assert_array_equal(synk.get_value(rank, s), [7, 14, 25])


@pytest.mark.parametrize("size", [5, LARGE], ids=["small", "chunked"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool"])
def test_int_avg_collectives_round_on_every_path(forked, size, dtype):
    n = forked
    rng = np.random.default_rng(size + n)
    hi = 2 if dtype == "bool" else 100
    parts = [rng.integers(0, hi, size).astype(dtype) for _ in range(n)]
    s = pytensor.shared(np.zeros(size, dtype=dtype), name="s")
    use(s)
    want = expected_avg_into(dtype, parts)
    set_each(s, parts)
    got = synk.reduce(s, "avg", in_place=False)
    assert got.dtype == np.dtype(dtype)
    assert_array_equal(got, want)
    synk.reduce(s, "avg")
    assert_array_equal(synk.get_value(0, s), want)
    set_each(s, parts)
    synk.all_reduce(s, "avg")
    for rank in range(n):
        got = synk.get_value(rank, s)
        assert got.dtype == np.dtype(dtype)
        assert_array_equal(got, want, err_msg=f"rank {rank}")


@pytest.mark.parametrize("size", [5, LARGE], ids=["small", "chunked"])
@pytest.mark.parametrize("dtype", ["int64", "uint64"])
def test_int_avg_at_the_top_of_64_bits_stays_there(forked, size, dtype):
    """float64 rounds the largest int64 (uint64) up to 2**63 (2**64): the avg of
    values there landed in the variable wrapped to the smallest (-2**63, 0)."""
    n = forked
    top = np.iinfo(dtype).max
    s = pytensor.shared(np.full(size, top, dtype=dtype), name="s")
    use(s)
    got = synk.reduce(s, "avg", in_place=False)
    assert got.dtype == np.dtype(dtype)
    assert_array_equal(got, np.full(size, top, dtype=dtype))
    synk.all_reduce(s, "avg")
    for rank in range(n):
        assert_array_equal(synk.get_value(rank, s), np.full(size, top, dtype=dtype), err_msg=f"rank {rank}")
    # an update accumulated over slices with avg lands the same way
    x = pt.dvector("x")
    c = pytensor.shared(np.array(top, dtype=dtype), name="c")
    f = synk.function([x], (x.sum(), "sum"), updates=[(c, c + pt.constant(np.array(0, dtype=dtype)), "avg")], mode=MODE)
    f(np.ones(4 * n), num_slices=2)
    for rank in range(n):
        assert synk.get_value(rank, c) == top, rank


@pytest.mark.parametrize("size", [3, LARGE], ids=["small", "chunked"])
def test_float16_avg_does_not_overflow_where_the_mean_fits(forked, size):
    """PyTensor's mean of float16 accumulates in float32; the avg summed float16 parts
    (equal weights: the sum times the reciprocal) and overflowed: 40000 averaged to inf."""
    n = forked
    x = pt.matrix("x", dtype="float16")
    f = synk.function([x], [pt.mean(x, axis=0), (pt.max(x, axis=0), "avg")], mode=MODE)
    value = np.full((2 * n, size), 40000, dtype=np.float16)
    value[1::2] = 39936  # (slices of one row differ: their avg is no shortcut)
    want = f.as_pytensor(value)
    for g, w in zip(f(value), want):  # (every process's max is 40000: their avg too)
        assert g.dtype == np.float16
        assert_array_equal(g, w)
    mean = f(value, num_slices=2)[0]  # (slices of one row: the avg of 40000 and 39936)
    assert mean.dtype == np.float16
    assert_array_equal(mean, want[0])
    s = pytensor.shared(np.full(size, 40000, dtype=np.float16), name="s")
    use(s)
    assert_array_equal(synk.reduce(s, "avg", in_place=False), np.full(size, 40000, np.float16))
    synk.all_reduce(s, "avg")
    for rank in range(n):
        assert_array_equal(synk.get_value(rank, s), np.full(size, 40000, np.float16), err_msg=f"rank {rank}")


def test_int_counter_with_num_slices_matches_as_pytensor(fork):
    fork(3)
    x = pt.dvector("x")
    c = pytensor.shared(np.int64(0), name="c")
    f = synk.function([x], (x.sum(), "sum"), updates=[(c, c + 7)], mode=MODE)
    f(np.ones(12), num_slices=3)
    got = [synk.get_value(r, c) for r in range(3)]
    f.as_pytensor(np.ones(12))  # the master's own copy: 7 + 7
    assert got == [7, 7, 7]
    assert c.get_value() == 14


@pytest.mark.parametrize("cols", [3, LARGE], ids=["small", "chunked"])
@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_int_output_avg_is_float64_whatever_its_size(forked, cols, dtype):
    n = forked
    m = pt.matrix("m", dtype=dtype)
    out = m.max(axis=0)
    f = synk.function([m], out, mode=MODE)  # default op: avg
    rng = np.random.default_rng(cols)
    rows = 7
    value = rng.integers(0, 2 if dtype == "bool" else 50, (rows, cols)).astype(dtype)
    for k in (1, 2):
        # each process averages its slices' maxima, then the processes are
        # averaged, weighted by rows: the same as one weighted average over slices
        maxima, weights = [], []
        for r in range(n):
            mine = value[rows_of(rows, n, r)]
            for sl in ([slice(None)] if k == 1 or len(mine) <= 1 else
                       [slice(*split(len(mine), k, j)) for j in range(k)]):
                if len(mine[sl]):
                    maxima.append(mine[sl].max(axis=0))
                    weights.append(len(mine[sl]))
        want = np.average(np.asarray(maxima, dtype=np.float64), axis=0, weights=weights)
        got = f(value, num_slices=k)
        assert got.dtype == np.float64, (k, got.dtype)
        assert_allclose(got, want, rtol=1e-12, err_msg=f"num_slices={k}")


# ---------------------------------------------------------------------------
# 2. casts follow PyTensor's set_value rule


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_collectives_refuse_lossy_casts(forked):
    n = forked
    i = pytensor.shared(np.array([3, 4], dtype=np.int64), name="i")
    f32 = pytensor.shared(np.array([1.0], dtype=np.float32), name="f32")
    use(i, f32)
    lossy = [
        (lambda: synk.broadcast(i, np.array([1.7, np.nan])), TypeError, "int64"),
        (lambda: synk.broadcast(i, [1.5, 2.0]), TypeError, "1.5"),
        (lambda: synk.set_value(n - 1, i, [1.9, -1.9]), TypeError, "1.9"),
        (lambda: synk.scatter(i, np.array([0.5] * 6)), TypeError, "float64"),
        (lambda: synk.scatter(i, [0.5] * 6), TypeError, "0.5"),
        (lambda: synk.broadcast(f32, np.array([1e300])), TypeError, "float32"),
        (lambda: synk.broadcast(f32, [1e300]), TypeError, "1e\\+300"),
        (lambda: synk.broadcast(i, [2 ** 70, 1]), OverflowError, "1180591620717411303424"),
        (lambda: synk.broadcast(i, np.array([1, 2], dtype=np.uint64)), TypeError, "uint64"),
    ]
    for call, err, text in lossy:
        with pytest.raises(err, match=text):
            call()
        for rank in range(n):
            assert_array_equal(synk.get_value(rank, i), [3, 4])
            assert_array_equal(synk.get_value(rank, f32), [1.0])
    # what PyTensor's set_value accepts is accepted (safe casts, ints from Python)
    synk.broadcast(i, [5, 6])
    synk.broadcast(f32, np.array([2], dtype=np.int16))
    synk.scatter(i, np.arange(2 * n, dtype=np.int32).reshape(n, 2).repeat(1, axis=0).ravel())
    for rank in range(n):
        assert synk.get_value(rank, f32).dtype == np.float32
        assert_array_equal(synk.get_value(rank, f32), [2.0])
    gathered = synk.gather(i, nd_up=0)
    assert_array_equal(gathered, np.arange(2 * n))


def test_data_values_follow_the_same_rule(fork):
    fork(2)
    i = pytensor.shared(np.zeros(4, dtype=np.int64), name="i")
    use(i)
    d = synk.data(np.full(4, 0.5))
    with pytest.raises(TypeError, match="float64"):
        synk.broadcast(i, d)
    assert_array_equal(synk.get_value(1, i), np.zeros(4))


# ---------------------------------------------------------------------------
# 3. num_slices never changes what an output is


def test_op_none_and_gather_do_not_depend_on_num_slices(forked):
    n = forked
    x = pt.dvector("x")
    f = synk.function([x], [(2 * x, None), (x + 1, "gather"), (x.sum(), "sum"), (x.mean(), "avg")],
                      mode=MODE)
    value = np.arange(12.0)
    whole = f(value)
    assert_allclose(whole[0], 2 * value[rows_of(12, n, 0)])
    for k in (2, 3, 5, 20):
        for got, want in zip(f(value, num_slices=k), whole):
            assert_allclose(got, want, rtol=1e-12, err_msg=f"num_slices={k}")


def test_zero_d_gather_or_none_with_num_slices_is_refused(forked):
    x = pt.dvector("x")
    f = synk.function([x], [(x.sum(), "gather"), (x.max(), None), (x.mean(), "avg")], mode=MODE)
    value = np.arange(12.0)
    assert len(f(value)[0]) == forked  # one value per process
    with pytest.raises(ValueError, match="0-d with op 'gather' or None"):
        f(value, num_slices=2)
    # the reducing outputs alone still slice
    assert_allclose(f(value, num_slices=2, output_subset=[2])[0], value.mean())
    assert len(f(value)[0]) == forked  # and the function still works


def test_outputs_that_are_not_row_wise_are_refused_with_num_slices(forked):
    x = pt.dvector("x")
    w = pytensor.shared(np.ones(3), name="w")
    f = synk.function([x], [(w * x.sum(), "gather"), (x.sum(), "sum")], mode=MODE)
    value = np.arange(30.0)
    assert f(value)[0].shape == (3 * forked,)
    with pytest.raises(ValueError, match="not one row per input row"):
        f(value, num_slices=2)
    assert f(value)[1] == value.sum()


@pytest.mark.parametrize("n", [1, 2])
def test_a_value_the_rows_do_not_change_is_exact_with_num_slices(fork, n):
    """An update or an ``avg`` output that every slice computes alike (a float32 step
    counter, a shared value) is that value with any ``num_slices``, in every process, as
    PyTensor gives it (an integer's avg in float64); the slices' row weights, rounded, need
    not add up to 1 (a counter ``t + 1`` came back 1 ulp off, differently per process, and
    drifted over calls)."""
    fork(n)
    x = pt.fmatrix("x")
    t = pytensor.shared(np.float32(0.5), name="t")
    w = pytensor.shared(np.array([0.1, 0.3, 0.7, 1.0, 3.0, 1e-3], np.float32), name="w")
    c = pytensor.shared(np.array([3, 4], np.int64), name="c")
    f = synk.function([x], [(x.sum(), "sum"), (w * 1, "avg"), (x.mean(axis=0) * 0 + t, "avg"), (c * 1, "avg")],
                      updates=[(t, t + np.float32(1))], mode=MODE)
    value = np.ones((13, 2), np.float32)  # 7 and 6 rows: slices of 2 and 1 rows
    whole = f(value)  # (the processes' avg, weighted 7/13 and 6/13, may round: alike with slices)
    want_t = np.float32(1.5)
    for k in (2, 3, 4, 7):
        for _ in range(20):
            got = f(value, num_slices=k)
            want_t += np.float32(1)
        assert got[1].tobytes() == whole[1].tobytes(), (k, got[1], whole[1])
        assert got[3].dtype == np.float64 and got[3].tolist() == [3.0, 4.0], (k, got[3])  # (avg of ints: float64)
        for r in range(n):
            assert synk.get_value(r, t).tobytes() == np.float32(want_t).tobytes(), (k, r, synk.get_value(r, t))


def test_all_gather_refused_changes_no_variable(fork):
    """A list all_gather whose second variable's shapes do not join along axis 0 raises a
    ValueError naming it, in every process, and leaves the first variable as it was
    (it used to be joined already)."""
    fork(2)
    a = pytensor.shared(np.array([1.0, 2.0]), name="a")
    e = pytensor.shared(np.zeros((1, 2)), name="e")
    use(a, e)
    synk.set_value(1, e, np.zeros((1, 3)))
    with pytest.raises(ValueError, match=r"all_gather: shared variable 'e' has shapes \[\(1, 2\), \(1, 3\)\]"):
        synk.all_gather([a, e])
    for r in range(2):
        assert_array_equal(synk.get_value(r, a), [1.0, 2.0])
    synk.set_value(1, e, np.ones((1, 2)))
    synk.all_gather([a, e])  # and the next one joins
    assert_array_equal(synk.get_value(1, e), [[0.0, 0.0], [1.0, 1.0]])


# ---------------------------------------------------------------------------
# 4. a variable listed twice


@pytest.mark.parametrize("size", [10, 100_000])
def test_variable_listed_twice_is_refused_everywhere(fork, size):
    fork(2)
    big = pytensor.shared(np.ones(size), name="big")
    other = pytensor.shared(np.ones(3), name="other")
    use(big, other)
    calls = {
        "all_reduce": lambda v: synk.all_reduce(v, "sum"),
        "reduce": lambda v: synk.reduce(v, "sum"),
        "broadcast": lambda v: synk.broadcast(v),
        "gather": lambda v: synk.gather(v),
        "all_gather": lambda v: synk.all_gather(v),
        "get_value": lambda v: synk.get_value(1, v),
        "get_shapes": lambda v: synk.get_shapes(v),
        "get_lengths": lambda v: synk.get_lengths(v),
        "scatter": lambda v: synk.scatter(v, [np.ones(4), np.ones(4)]),
        "set_value": lambda v: synk.set_value(1, v, [np.ones(4), np.ones(4)]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"\['big'\] are listed more than once"):
            call([big, other, big])
    synk.all_reduce([big, other], "sum")
    assert_array_equal(synk.get_value(1, big), np.full(size, 2.0))


# ---------------------------------------------------------------------------
# 5. a command issued while another runs in the same thread


class _GatherInPerform(Op):
    """An Op whose perform calls synkhronos: a nested command in the master."""

    __props__ = ()

    def __init__(self, var=None):
        self.var = var

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        synk.gather(self.var)
        outputs[0][0] = inputs[0].copy()


def test_nested_command_from_an_op_is_refused_and_the_runtime_stays_usable(fork):
    fork(2)
    w = pytensor.shared(np.arange(3.0), name="w")
    x = pt.dvector("x")
    plain = synk.function([x], (x * w.sum(), "gather"), mode=MODE)
    nested = synk.function([x], (_GatherInPerform(w)(x), "gather"), mode=MODE)
    synk.distribute()
    with pytest.raises(RuntimeError, match=r"gather\(\) was called while another synkhronos command"):
        nested(np.ones(4))
    assert_allclose(plain(np.ones(4)), np.full(4, 3.0))
    assert_allclose(synk.gather(w), [np.arange(3.0)] * 2)


def test_nested_command_from_a_signal_handler_is_refused(fork):
    fork(2)
    w = pytensor.shared(np.arange(3.0), name="w")
    x = pt.dvector("x")
    # a slow step: the signal lands while the command runs
    slow = synk.function([x], (pt.sum(pt.sort(pt.tile(x, 400))) + 0 * w.sum(), "sum"), mode=MODE)
    synk.distribute()
    outcomes = []

    def checkpoint(signum, frame):
        try:
            synk.gather(w)
            outcomes.append("ran")  # between two commands: allowed, and correct
        except RuntimeError as err:
            outcomes.append(err)

    old = signal.signal(signal.SIGUSR1, checkpoint)
    value = np.random.default_rng(0).normal(size=20_000)
    try:
        for _ in range(20):  # until a signal came during a command
            before = len(outcomes)
            timer = threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            while len(outcomes) == before:
                got = slow(value)
                assert got == pytest.approx(400 * value.sum())  # never corrupted
            timer.join()
            if isinstance(outcomes[-1], RuntimeError):
                break
    finally:
        signal.signal(signal.SIGUSR1, old)
    refused = [o for o in outcomes if isinstance(o, RuntimeError)]
    assert refused, outcomes
    assert "while another synkhronos command" in str(refused[0])
    assert_allclose(synk.gather(w), [np.arange(3.0)] * 2)
