"""Collectives on small shared variables (the inline path of synkhronos/_shareds/host.py) give the
bits of the communicator's path and of numpy, in every process, for every op,
dtype and shape; errors and the switch between small and large values stay right."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np
import pytensor
import pytest
from numpy.testing import assert_array_equal

import synkhronos as synk
from synkhronos._shareds import host as shareds
from synkhronos.collectives import shm
from synkhronos._protocol.session import ALIVE_EVERY

from conftest import MODE, worker_pids
from model_lib import reduce_collective

#: (dtype, shape) of the variables every fork holds: 0-d, vectors, matrices, empty.
LAYOUTS = [("float32", ()), ("float64", (3,)), ("int64", (2, 3)), ("int32", ()), ("bool", (4,)),
           ("uint8", (5,)), ("float32", (0, 3)), ("int8", (2, 2)), ("float64", ())]
OPS = ["sum", "avg", "prod", "max", "min"]


def _random_value(rng, dtype, shape):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("float"):
        return (rng.standard_normal(shape) * 10).astype(dtype)
    small = np.iinfo(dtype).bits <= 8
    return rng.integers(-3 if dtype != "uint8" else 0, 4 if small else 1000, size=shape).astype(dtype)


def _numpy_reduce(parts, op, dtype):
    """What the reduction stores in a variable of ``dtype``: a fold in rank order;
    avg as the sum times the reciprocal of the count (integers in float64), rounded into integers
    (the model-based test's recipe)."""
    return reduce_collective(parts, op, dtype)


def _make_vars(n_sets=1):
    vars_ = [pytensor.shared(np.zeros(shape, dtype=dtype), name=f"v{k}_{dtype}")
             for k, (dtype, shape) in enumerate(LAYOUTS * n_sets)]
    synk.function([], [v.sum() for v in vars_], mode=MODE)
    synk.distribute()
    return vars_


def _set_per_rank(rng, n, vars_):
    """A random value per variable per rank; returns them [rank][var]."""
    values = [[_random_value(rng, v.dtype, v.get_value().shape) for v in vars_] for _ in range(n)]
    for rank in range(n):
        synk.set_value(rank, vars_, values[rank])
    return values


def _each(v, n):
    return [synk.get_value(r, v) for r in range(n)]


def _the_communicator_path(monkeypatch):
    """Every collective from now on through the communicator, as before the inline path."""
    monkeypatch.setattr(shareds, "INLINE_KINDS", frozenset())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_inline_results_match_numpy_and_the_communicator_path(fork, n, monkeypatch):
    fork(n)
    rng = np.random.default_rng(n)
    vars_ = _make_vars()
    for case in range(40):
        op = OPS[case % len(OPS)]
        pick = [vars_[i] for i in sorted(rng.choice(len(vars_), size=1 + case % 4, replace=False))]
        values = _set_per_rank(rng, n, vars_)
        wanted = {id(v): _numpy_reduce([values[r][vars_.index(v)] for r in range(n)], op, v.dtype)
                  for v in pick}
        # all_reduce: every process holds the result, in the variable's dtype
        synk.all_reduce(pick if case % 2 else pick[0] if len(pick) == 1 else pick, op=op)
        for v in pick:
            for r, got in enumerate(_each(v, n)):
                assert got.dtype == np.dtype(v.dtype) and got.shape == wanted[id(v)].shape
                assert_array_equal(got, wanted[id(v)], err_msg=f"{op} of {v.name} on rank {r}")
        # reduce to the master, returned and in place
        values = _set_per_rank(rng, n, vars_)
        got = synk.reduce(pick, op=op, in_place=False)
        for v, g in zip(pick, got):
            assert_array_equal(g, _numpy_reduce([values[r][vars_.index(v)] for r in range(n)], op, v.dtype))
            assert g.dtype == np.dtype(v.dtype)
        # gather, stacked and concatenated
        stacked = synk.gather(pick, nd_up=1)
        for v, g in zip(pick, stacked):
            assert_array_equal(g, np.stack([values[r][vars_.index(v)] for r in range(n)]))
        # broadcast of the master's values, then of given ones
        synk.broadcast(pick)
        for v in pick:
            for got in _each(v, n):
                assert_array_equal(got, values[0][vars_.index(v)])
    # bit for bit the communicator's path, on the same values
    for op in OPS:
        values = _set_per_rank(rng, n, vars_)
        reduced = synk.reduce(vars_, op=op, in_place=False)
        synk.all_reduce(vars_, op=op)
        inline = [_each(v, n) for v in vars_]
        with monkeypatch.context() as m:
            _the_communicator_path(m)
            for rank in range(n):
                synk.set_value(rank, vars_, values[rank])
            old_reduced = synk.reduce(vars_, op=op, in_place=False)
            synk.all_reduce(vars_, op=op)
            old = [_each(v, n) for v in vars_]
        for v, a, b, ra, rb in zip(vars_, inline, old, reduced, old_reduced):
            assert ra.dtype == rb.dtype and ra.tobytes() == rb.tobytes(), f"reduce {op} of {v.name}"
            for r in range(n):
                assert a[r].dtype == b[r].dtype and a[r].tobytes() == b[r].tobytes(), f"{op} of {v.name}"


def test_many_variables_in_one_call_and_in_place_reduce(fork):
    fork(3)
    rng = np.random.default_rng(7)
    vars_ = _make_vars(n_sets=3)
    values = _set_per_rank(rng, 3, vars_)
    synk.reduce(vars_, op="sum")  # in place: the master's variables change, the workers' do not
    for k, v in enumerate(vars_):
        assert_array_equal(v.get_value(), _numpy_reduce([values[r][k] for r in range(3)], "sum", v.dtype))
        assert_array_equal(synk.get_value(2, v), values[2][k])
    synk.broadcast(vars_, [values[1][k] for k in range(len(vars_))])
    for k, v in enumerate(vars_):
        for got in _each(v, 3):
            assert_array_equal(got, values[1][k])


@pytest.mark.parametrize("n", [2, 3])
def test_a_variable_that_grows_past_the_inline_areas_and_shrinks_back(fork, n):
    fork(n)
    v = pytensor.shared(np.zeros(4), name="v")
    w = pytensor.shared(np.zeros((), dtype=np.int64), name="w")
    synk.function([], [v.sum(), w.sum()], mode=MODE)
    synk.distribute()
    big = shm.INLINE_CAP // 8 + 100  # float64 elements: more than an area holds
    for step, length in enumerate([4, big, 3, 5 * big, 1, big, 4]):
        synk.scatter(v, np.arange(n * length, dtype=np.float64) + step)  # every rank its own rows
        parts = [np.arange(n * length, dtype=np.float64)[r * length:(r + 1) * length] + step for r in range(n)]
        for op in ("sum", "avg", "max"):
            for rank in range(n):
                synk.set_value(rank, v, parts[rank])
            synk.all_reduce([v, w], op=op)
            for got in _each(v, n):
                assert_array_equal(got, _numpy_reduce(parts, op, "float64"))
        assert_array_equal(synk.gather(v, nd_up=0), np.concatenate([_numpy_reduce(parts, "max", "float64")] * n))


def test_gather_of_unequal_lengths_across_the_threshold(fork):
    fork(3)
    v = pytensor.shared(np.zeros(2), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    big = np.arange(shm.INLINE_CAP // 8 + 10, dtype=np.float64)
    synk.set_value(2, v, big)  # the master's fits its area, rank 2's does not
    got = synk.gather(v, nd_up=0)
    assert_array_equal(got, np.concatenate([np.zeros(2), np.zeros(2), big]))
    with pytest.raises(ValueError, match=r"gather\(nd_up=1\) needs equal shapes"):
        synk.gather(v, nd_up=1)
    synk.set_value(1, v, np.ones(3))
    assert_array_equal(synk.gather(v, nd_up=0), np.concatenate([np.zeros(2), np.ones(3), big]))


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_shapes_raise_in_the_master_and_change_nothing(fork, n):
    fork(n)
    a = pytensor.shared(np.zeros(3), name="a")
    b = pytensor.shared(np.ones(()), name="b")
    synk.function([], [a.sum(), b.sum()], mode=MODE)
    synk.distribute()
    for bad in (np.full(4, 2.0), np.full(shm.INLINE_CAP // 8 + 1, 2.0)):  # fits its area, and does not
        synk.set_value(n - 1, a, bad)
        shown = rf"\[\('float64', \(3,\)\), \('float64', \(\)\)\] but rank {n - 1} holds " \
                rf"\[\('float64', \({len(bad)},\)\), \('float64', \(\)\)\]"
        for call in (lambda: synk.all_reduce([a, b], op="sum"), lambda: synk.reduce([a, b], op="max")):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=rf"cannot (sum|max)-reduce: rank 0 holds {shown}"):
                call()
            assert time.monotonic() - t0 < 5
        assert_array_equal(synk.get_value(n - 1, a), bad)  # nothing changed anywhere
        for r in range(n - 1):
            assert_array_equal(synk.get_value(r, a), np.zeros(3))
        for got in _each(b, n):
            assert_array_equal(got, np.ones(()))
    synk.set_value(n - 1, a, np.ones(3))
    synk.all_reduce([a, b], op="sum")
    for got in _each(a, n):
        assert_array_equal(got, np.full(3, 1.0))
    for got in _each(b, n):
        assert_array_equal(got, np.full((), float(n)))


def test_borrowed_values_stay_the_variables_after_small_collectives(fork):
    """A value in its home is updated in place (as by the communicator's all_reduce);
    one that is not is never written: a borrowed array keeps what it held."""
    fork(2)
    v = pytensor.shared(np.full(3, 2.0), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    mine = np.full(3, 5.0)
    v.set_value(mine, borrow=True)
    synk.all_reduce(v, op="sum")  # the worker holds 2.0
    assert_array_equal(v.get_value(), np.full(3, 7.0))
    assert_array_equal(mine, np.full(3, 5.0))
    home = v.get_value(borrow=True)
    synk.all_reduce(v, op="sum")
    assert v.get_value(borrow=True) is home
    assert_array_equal(home, np.full(3, 14.0))
    synk.broadcast(v, np.full(3, 1.0))
    assert_array_equal(synk.get_value(1, v), np.full(3, 1.0))


@pytest.mark.parametrize("n", [2, 3])
def test_a_worker_killed_or_stuck_during_a_small_all_reduce_is_noticed(fork, n):
    fork(n, timeout=3)
    v = pytensor.shared(np.ones(2), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    synk.all_reduce(v, "sum")
    pids = worker_pids()
    os.kill(pids[n - 1], signal.SIGSTOP)  # stuck: the timeout ends the wait
    try:
        synk.all_reduce(v, "sum")  # every worker idle, its value where it published it: no command
        v.set_value(np.ones(2))  # a new value here: the next one is a command again
        t0 = time.monotonic()
        with pytest.raises(synk.SynkTimeoutError):
            synk.all_reduce(v, "sum")
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(pids[n - 1], signal.SIGCONT)
    synk.broadcast(v, np.full(2, 3.0))  # it came back: usable again (the next command settles the old one)
    synk.all_reduce(v, "sum")
    for got in _each(v, n):
        assert_array_equal(got, np.full(2, 3.0 * n))
    synk.all_reduce(v, "sum")
    os.kill(pids[n - 1], signal.SIGKILL)
    # with every worker idle no command is sent: a dead worker is noticed as a
    # kept plan's liveness check notices it, within ALIVE_EVERY of the kernel's word that it died
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match=f"rank {n - 1}"):
        while time.monotonic() - t0 < 5:
            synk.all_reduce(v, "sum")
            time.sleep(ALIVE_EVERY / 4)


def test_kept_gathers_follow_the_values_refuse_bad_arguments_and_notice_a_dead_worker(fork):
    """A gather again of values that stayed put takes no command and returns new
    memory; a new shape, an update, a bad nd_up and a dead worker are all seen."""
    fork(2)
    v = pytensor.shared(np.arange(3.0), name="v")
    bump = synk.function([], v.sum(), updates=[(v, v + 1)], mode=MODE)
    synk.distribute()
    ctl = synk._runtime.running_session().proc.control
    synk.gather(v)
    before = ctl.commands()
    got = synk.gather(v)
    assert ctl.commands() == before  # the master read the worker's value where it lives
    assert_array_equal(got, [[0, 1, 2], [0, 1, 2]])
    got[:] = 99  # new memory: nobody's value
    assert_array_equal(synk.gather(v), [[0, 1, 2], [0, 1, 2]])
    assert_array_equal(synk.gather(v, nd_up=0), [0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="nd_up must be 0"):
        synk.gather(v, nd_up=True)  # (True == 1: the kept plan of nd_up=1 must not take it)
    v.set_value(np.arange(4.0))  # the master's shape changes: the workers' does not
    with pytest.raises(ValueError, match="equal shapes"):
        synk.gather(v)
    assert_array_equal(synk.gather(v, nd_up=0), [0, 1, 2, 3, 0, 1, 2])
    v.set_value(np.arange(3.0))
    synk.gather(v)
    bump()  # every process's value moves (an update)
    assert_array_equal(synk.gather(v), [[1, 2, 3], [1, 2, 3]])
    assert_array_equal(synk.gather(v), [[1, 2, 3], [1, 2, 3]])
    synk.set_value(1, v, np.full(3, 7.0))
    assert_array_equal(synk.gather(v), [[1, 2, 3], [7, 7, 7]])
    os.kill(worker_pids()[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1"):
        while time.monotonic() - t0 < 5:
            synk.gather(v)
            time.sleep(ALIVE_EVERY / 4)


def test_kept_reduces_follow_the_values_refuse_bad_arguments_and_notice_a_dead_worker(fork):
    """A reduce again of values that stayed put takes no command; it returns new
    memory, or stores in the master alone; a new op, an update, set_value, bad
    arguments and a dead worker are all seen."""
    fork(2)
    v = pytensor.shared(np.arange(3.0), name="v")
    k = pytensor.shared(np.array([1, 2, 4], dtype="int64"), name="k")
    bump = synk.function([], v.sum() + k.sum(), updates=[(v, v + 1)], mode=MODE)
    synk.distribute()
    ctl = synk._runtime.running_session().proc.control
    synk.set_value(1, v, np.array([2.0, 3.0, 5.0]))
    synk.set_value(1, k, np.array([2, 2, 2], dtype="int64"))
    synk.reduce(v, "avg", in_place=False)
    before = ctl.commands()
    got = synk.reduce(v, "avg", in_place=False)
    assert ctl.commands() == before  # the master read the worker's value where it lives
    assert_array_equal(got, [1.0, 2.0, 3.5])
    got[:] = 99  # new memory: nobody's value
    assert_array_equal(synk.reduce(v, "avg", in_place=False), [1.0, 2.0, 3.5])
    assert_array_equal(synk.reduce(v, "max", in_place=False), [2.0, 3.0, 5.0])
    assert_array_equal(synk.reduce(v, "c_sum", in_place=False), [2.0, 4.0, 7.0])
    synk.reduce([v, k], "avg", in_place=False)
    before = ctl.commands()
    fv, fk = synk.reduce([v, k], "avg", in_place=False)
    assert ctl.commands() == before
    assert fk.dtype == np.int64 and list(fk) == [2, 2, 3]  # (1.5 -> 2, 2 -> 2, 3 -> 3: rounded, ties to even)
    with pytest.raises(ValueError, match="bogus"):
        synk.reduce(v, "bogus")
    with pytest.raises(TypeError):
        synk.reduce(v, ["avg"])
    synk.reduce(v, "sum")  # in place: the master's value, and only the master's
    synk.reduce(v, "sum")
    assert_array_equal(synk.get_value(0, v), [4.0, 7.0, 12.0])
    assert_array_equal(synk.get_value(1, v), [2.0, 3.0, 5.0])
    bump()  # every process's value moves (an update)
    assert_array_equal(synk.reduce(v, "sum", in_place=False), [8.0, 12.0, 19.0])
    assert_array_equal(synk.reduce(v, "sum", in_place=False), [8.0, 12.0, 19.0])
    synk.set_value(1, v, np.full(3, 7.0))
    assert_array_equal(synk.reduce(v, "sum", in_place=False), [12.0, 15.0, 20.0])
    os.kill(worker_pids()[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1"):
        while time.monotonic() - t0 < 5:
            synk.reduce(v, "sum", in_place=False)
            time.sleep(ALIVE_EVERY / 4)
    for again in (lambda: synk.reduce(v, "sum", in_place=False), lambda: synk.gather(v),
                  lambda: synk.broadcast(v), lambda: synk.all_reduce(v, "sum")):
        with pytest.raises(synk.SynkError):  # the fork is broken: no kept plan runs again
            again()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # prod overflows, in numpy as here
@pytest.mark.parametrize("n", [2, 3])
def test_kept_reduces_match_numpy_over_random_cases(fork, n):
    """Over random values, variables, ops and in_place: a reduce repeated with
    the same arguments takes no command and gives numpy's bits, as the first
    (a command) did; in place, only the master's value changes."""
    rng = np.random.default_rng(300 + n)
    fork(n)
    vars_ = _make_vars()
    ctl = synk._runtime.running_session().proc.control
    direct = 0
    for case in range(60):
        held = _set_per_rank(rng, n, vars_)
        ks = sorted({int(rng.integers(0, len(vars_))) for _ in range(int(rng.integers(1, 4)))})
        op, in_place = OPS[int(rng.integers(0, len(OPS)))], bool(rng.random() < 0.3)
        pick = [vars_[k] for k in ks]
        wants = [_numpy_reduce([held[r][k] for r in range(n)], op, vars_[k].dtype) for k in ks]
        for attempt in range(2):  # the first by the inline command, the second directly
            before = ctl.commands()
            got = synk.reduce(pick, op, in_place=in_place)
            if attempt:
                direct += ctl.commands() == before
            if in_place:
                got = [synk.get_value(0, v) for v in pick]
                for v, k in zip(pick, ks):
                    synk.set_value(0, v, held[0][k])  # the next attempt reduces the same values
            for g, want, k in zip(got, wants, ks):
                label = f"case {case} attempt {attempt}: reduce({op}, in_place={in_place}) of {vars_[k].name}"
                assert g.dtype == want.dtype and g.shape == want.shape, label
                assert_array_equal(g, want, err_msg=label)
        for r in range(1, n):
            for k in ks:
                assert_array_equal(synk.get_value(r, vars_[k]), held[r][k])
    assert direct == 60  # every repeat (set_value of the master moves no worker value: the plan holds)


@pytest.mark.parametrize("n", [2, 3])
def test_complex_products_have_the_same_bits_on_every_path(fork, n):
    """numpy multiplies one complex element by another loop (other last bits) when the
    output is an operand: a kept all_reduce run directly (into the master's value, the
    first part) gave other bits than the same one by a command (into new memory) in 2 of 5
    cases, and 3 processes (a fold into its accumulator) other bits than numpy's fold
    into new memory. Every path now gives ``functools.reduce(np.multiply, parts)``'s."""
    rng = np.random.default_rng(40 + n)
    fork(n)
    layouts = [("complex128", ()), ("complex64", (1,)), ("complex64", ()), ("complex128", (3,))]
    vars_ = [pytensor.shared(np.zeros(shape, dtype), name=f"c{k}") for k, (dtype, shape) in enumerate(layouts)]
    synk.function([], [v.sum() for v in vars_], mode=MODE)
    synk.distribute()
    ctl = synk._runtime.running_session().proc.control
    paths = {True: 0, False: 0}
    for case in range(48):
        k = case % len(vars_)
        v, (dtype, shape) = vars_[k], layouts[k]
        held = [(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype) for _ in range(n)]
        for r in range(n):
            synk.set_value(r, v, held[r])
        want = np.asarray(functools.reduce(np.multiply, held)).astype(dtype)
        got = synk.reduce(v, "prod", in_place=False)  # (a read: by command, or directly)
        assert got.tobytes() == want.tobytes(), f"case {case}: reduce of {v.name} {got!r} {want!r}"
        for attempt in range(2):  # by a command, then directly from the values the first left
            before = ctl.commands()
            synk.all_reduce(v, op="prod")
            paths[ctl.commands() == before] += 1
            for r in range(n):
                got = synk.get_value(r, v)
                assert got.tobytes() == want.tobytes(), f"case {case} attempt {attempt}: {v.name} on rank {r}"
            want = np.asarray(functools.reduce(np.multiply, [want] * n)).astype(dtype)
    assert paths[True] >= 40 and paths[False] >= 40  # both paths were taken


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # prod loops overflow, in numpy as here
@pytest.mark.parametrize("n", [2, 3])
def test_loops_without_commands_match_numpy(fork, n):
    """Random loops of small all_reduces and broadcasts, mixed with what moves a
    value away from where a worker published it (a call that updates it in every
    process, set_value in one process, broadcast of new values, a shape that
    differs): every process holds what plain numpy says, bit for bit, whether a
    collective went to the workers as a command or the master did it alone; and
    gathers and reduces in between (their own random stream, the loop's stays
    as it was) return what every process holds, and numpy's reduction of it."""
    rng, grng = np.random.default_rng(n), np.random.default_rng(100 + n)
    fork(n)
    vars_ = _make_vars()
    a = pytensor.shared(np.zeros(3), name="a")  # updated by a call: a <- 2a - 1 in every process
    step = synk.function([], a.sum(), updates=[(a, 2 * a - 1)], mode=MODE)
    # swapped by a call (PyTensor may hand one's old storage to the other)
    b, c = pytensor.shared(np.zeros(2, np.float32), name="b"), pytensor.shared(np.ones(2, np.float32), name="c")
    swap = synk.function([], b.sum(), updates=[(b, c), (c, b)], mode=MODE)
    synk.distribute()
    every = vars_ + [b, c, a]
    ib, ic = len(vars_), len(vars_) + 1
    held = _set_per_rank(rng, n, every)  # held[rank][k]: what rank holds of every[k]
    ctl = synk._runtime.running_session().proc.control
    alone, read_alone = 0, {"gather": 0, "reduce": 0}
    for i in range(400):
        kind = _gather_and_check(grng, every, held, n, ctl, f"before step {i}")
        if kind is not None:
            read_alone[kind] += 1
        what, k = rng.integers(0, 10), int(rng.integers(0, len(every)))
        before = ctl.commands()
        if what <= 4:  # all_reduce of one variable, or of two
            ks = [k] if what <= 2 else sorted({k, int(rng.integers(0, len(every)))})
            op = OPS[int(rng.integers(0, len(OPS)))]
            synk.all_reduce(every[ks[0]] if len(ks) == 1 else [every[j] for j in ks], op=op)
            for j in ks:
                got = _numpy_reduce([held[r][j] for r in range(n)], op, every[j].dtype)
                for r in range(n):
                    held[r][j] = got
        elif what <= 6:
            synk.broadcast(every[k])
            for r in range(1, n):
                held[r][k] = held[0][k]
        elif what == 7:
            value = _random_value(rng, every[k].dtype, held[0][k].shape)
            if rng.random() < 0.5:
                synk.broadcast(every[k], value)
                for r in range(n):
                    held[r][k] = value
            else:
                r = int(rng.integers(0, n))
                synk.set_value(r, every[k], value)
                held[r][k] = value
        elif what == 8 and rng.random() < 0.5:
            step()
            for r in range(n):
                held[r][-1] = 2 * held[r][-1] - 1
        elif what == 8:
            swap()
            for r in range(n):
                held[r][ib], held[r][ic] = held[r][ic], held[r][ib]
        elif held[0][k].ndim:  # another shape in one worker: refused, changing nothing; then the old one back
            v, r, shape = every[k], int(rng.integers(1, n)), held[0][k].shape
            synk.set_value(r, v, _random_value(rng, v.dtype, (shape[0] + 1,) + shape[1:]))
            with pytest.raises(ValueError, match=f"rank {r} holds"):
                synk.all_reduce(v, op="sum")
            synk.set_value(r, v, held[r][k])
        alone += ctl.commands() == before
        if i % 25 == 0 or i == 399:
            for j, v in enumerate(every):
                for r, got in enumerate(_each(v, n)):
                    assert_array_equal(got, held[r][j], err_msg=f"step {i}, rank {r}, {v.name}")
                    assert got.dtype == held[r][j].dtype
    # the master did many of them alone (a gather as a command moves a worker's value into its home,
    # which sends the next all_reduce of it as a command: fewer than without the gathers, 49-61 of 400)
    assert alone > 40
    # (most follow a step that moved a value; a reduce's plan is kept per variables, op and in_place: 1-2 of ~80)
    assert read_alone["gather"] > 6 and read_alone["reduce"] > 0


def _gather_and_check(rng, every, held, n, ctl, where) -> bool:
    """Now and then a gather of one or two of ``every``, stacked or concatenated,
    or a reduce of them (returned, or now and then stored in the master's
    variables: ``held[0]`` follows), checked against what each process holds
    and numpy; its kind when it took no command, else None."""
    if rng.random() < 0.5:
        return None
    ks = sorted({int(rng.integers(0, len(every))), int(rng.integers(0, len(every)))})
    pick = [every[k] for k in ks]
    before = ctl.commands()
    if rng.random() < 0.4:  # a reduce
        # mostly one op (a plan is kept per variables, op and in_place): some repeat one
        op = "avg" if rng.random() < 0.6 else OPS[int(rng.integers(0, len(OPS)))]
        in_place = bool(rng.random() < 0.2)
        got = synk.reduce(pick, op=op, in_place=in_place)
        for i, k in enumerate(ks):
            want = _numpy_reduce([held[r][k] for r in range(n)], op, every[k].dtype)
            g = synk.get_value(0, every[k]) if in_place else got[i]
            assert g.dtype == want.dtype and g.shape == want.shape, (where, every[k].name)
            assert_array_equal(g, want, err_msg=f"{where}: reduce({op}, in_place={in_place}) of {every[k].name}")
            if in_place:
                held[0][k] = want
        return "reduce" if ctl.commands() == before else None
    nd_up = 1 if any(held[0][k].ndim == 0 for k in ks) else int(rng.integers(0, 2))
    got = synk.gather(pick, nd_up=nd_up)
    for k, g in zip(ks, got):
        parts = [held[r][k] for r in range(n)]
        want = np.stack(parts) if nd_up else np.concatenate(parts)
        assert g.dtype == want.dtype and g.shape == want.shape, (where, every[k].name)
        assert_array_equal(g, want, err_msg=f"{where}: gather of {every[k].name}")
    return "gather" if ctl.commands() == before else None


def test_ctrl_c_anywhere_in_small_collectives_leaves_correct_collectives(fork):
    fork(3)
    s = pytensor.shared(np.arange(4.0), name="s")
    synk.function([], s.sum(), mode=MODE)
    synk.distribute()
    master, hits = os.getpid(), 0
    for trial in range(8):
        timer = threading.Timer(0.002 + 0.003 * trial, os.kill, (master, signal.SIGINT))
        try:  # start() inside: on a busy machine the signal may land before start() returns
            timer.start()
            end = time.monotonic() + 30
            while time.monotonic() < end:
                synk.all_reduce(s, "max")
                synk.broadcast(s)
                synk.reduce(s, "sum", in_place=False)
        except KeyboardInterrupt:
            hits += 1
        timer.join()
        synk.broadcast(s, np.arange(4.0) + trial)
        synk.all_reduce(s, "sum")
        assert_array_equal(synk.gather(s, nd_up=1), np.stack([3 * (np.arange(4.0) + trial)] * 3))
    assert hits == 8


@pytest.mark.parametrize("n", [2, 3])
def test_other_threads_of_the_master_run_during_a_loop_of_kept_collectives(fork, n):
    """A loop of kept small collectives, which run in the master alone, leaves the GIL
    to the master's other threads. Its liveness check released the GIL every 1 ms:
    more often than Python's switch interval, so another thread never got it back (on
    3 processes and 2 cores, a thread sleeping 1 ms at a time ran 0 to 10 times in
    3 s, and a threading.Timer of 5 ms fired after up to 30 s)."""
    fork(n)
    s = pytensor.shared(np.arange(4.0), name="s")
    synk.function([], s.sum(), mode=MODE)
    synk.distribute()
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            time.sleep(0.001)
            ticks.append(time.monotonic())

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        synk.all_reduce(s, "max")  # the plans are kept from here on
        synk.broadcast(s)
        t0, loops = time.monotonic(), 0
        while time.monotonic() - t0 < 2.0:
            synk.all_reduce(s, "max")
            synk.broadcast(s)
            loops += 1
        end = time.monotonic()
    finally:
        stop.set()
        thread.join(5)
    marks = [t0] + [t for t in ticks if t0 <= t <= end] + [end]
    longest = max(b - a for a, b in zip(marks, marks[1:]))
    # it gets the GIL within a switch interval or two: the longest gap was 15-20 ms here,
    # and 1.6-2 s before the fix
    assert longest < 0.5, (f"the master's other thread waited {longest:.2f} s for the GIL during "
                           f"{loops} kept collectives ({len(marks) - 2} turns in 2 s)")
