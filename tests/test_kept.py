"""The rules kept state relies on (synkhronos/_kept/records.py), each as a test.

One owner per process (``proc.kept``), one capacity policy (:class:`Table`),
one validity rule (``Kept.generation``: every posted command and every
released ``synk.data`` moves it; a kept plan verified under an older
generation runs directly only after the workers' boards were checked again).
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import MODE
from numpy.testing import assert_array_equal

import synkhronos as synk
from synkhronos import _runtime as runtime
from synkhronos._kept import plans
from synkhronos._kept.records import Kept, Mode, Table
from synkhronos.collectives.base import CommPlan
from synkhronos.collectives.shm import ShmCommunicator


def test_a_full_table_drops_its_oldest_record_only():
    t = Table(3)
    for k in range(3):
        assert t.keep(k, str(k)) == str(k)
    t.keep(1, "one again")  # a key already held: nothing dropped
    assert list(t) == [0, 1, 2] and t[1] == "one again"
    t.keep(3, "3")
    assert list(t) == [1, 2, 3]
    with pytest.raises(ValueError, match="capacity of at least 1, got 0"):
        Table(0)


def test_clear_drops_every_record_and_moves_the_generation():
    k = Kept()
    g = k.generation
    k.plans.keep("p", 1)
    k.calls_of(7).keep("c", 2)
    k.published[3] = "home"
    k.clear()
    assert k.generation == g + 1
    assert not k.plans and not k.calls_of(7) and not k.published
    assert k.moved() == g + 2


def _kept():
    return runtime.running_session().proc.kept


def _commands():
    return runtime.running_session().proc.control.commands()


def test_every_command_and_every_released_data_moves_the_generation(fork):
    fork(2)
    v = pytensor.shared(np.zeros(3), name="v")
    x = pytensor.tensor.vector("x")
    f = synk.function([x], (x * v.sum()).sum(), updates=[(v, v + 1)], mode=MODE)
    kept = _kept()
    steps = [
        ("distribute", synk.distribute),
        ("call", lambda: f(np.ones(4))),
        ("set_value", lambda: synk.set_value(1, v, np.ones(3))),
        ("scatter", lambda: synk.scatter(v, np.arange(6.0))),
        ("broadcast with values", lambda: synk.broadcast(v, np.zeros(3))),
        ("get_value", lambda: synk.get_value(1, v)),
        ("all_gather", lambda: synk.all_gather(v)),
    ]
    for what, step in steps:
        before, commands = kept.generation, _commands()
        step()
        assert _commands() > commands, what
        assert kept.generation > before, what
    d = synk.data(np.zeros((4, 2)))
    before = kept.generation
    d.set_value(np.zeros((400, 2)))  # reallocated: the old segment is released
    assert kept.generation > before
    before = kept.generation
    d.free_memory()
    assert kept.generation > before


def test_a_direct_collective_moves_nothing_and_a_command_sends_the_next_to_the_boards(fork):
    fork(2)
    v = pytensor.shared(np.arange(3.0), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    kept = _kept()
    synk.all_reduce(v, op="sum")        # the full path: keeps a plan
    plan = next(p for key, p in kept.plans.items() if key[0] == "all_reduce")
    synk.all_reduce(v, op="sum")        # first repeat: verified on the boards, then direct
    assert plan.verified == kept.generation
    commands, generation = _commands(), kept.generation
    synk.all_reduce(v, op="sum")        # trusted under this generation: no command
    assert (_commands(), kept.generation) == (commands, generation)
    assert plan._mode() is Mode.DIRECT
    synk.set_value(1, v, np.full(3, 5.0))  # a command: a new generation, rank 1's value elsewhere
    assert kept.generation > plan.verified
    assert plan._mode() is Mode.COMMAND  # the board no longer shows the home the plan found
    synk.all_reduce(v, op="sum")
    assert _commands() == commands + 2  # set_value, then the all_reduce as its command
    want = 8 * np.arange(3.0) + 5.0  # rank 0 holds 8x its start after three sums, rank 1 the 5s
    for r in range(2):
        assert_array_equal(synk.get_value(r, v), want)


def test_a_worker_publishes_at_most_its_table_s_capacity_and_the_rest_stay_right(fork):
    fork(2)
    vs = [pytensor.shared(np.full(2, float(k)), name=f"v{k}") for k in range(24)]
    synk.function([], sum(v.sum() for v in vs), mode=MODE)
    synk.distribute()
    for rep in range(3):
        for v in vs:
            synk.all_reduce(v, op="sum")
    for k, v in enumerate(vs):
        for r in range(2):
            assert_array_equal(synk.get_value(r, v), np.full(2, k * 8.0), err_msg=v.name)
    capacity = _kept().published.capacity
    # every worker's board names at most ``capacity`` homes (the rest went by command)
    comm = runtime.running_session().proc.comm
    board = comm.home_board(1)
    assert 0 < sum(1 for slot in range(comm.home_slots) if board[slot]) <= capacity


@pytest.mark.parametrize("master_rank", [0, 1])
def test_a_call_weighted_by_its_sliceable_rows_follows_their_lengths(fork, master_rank):
    """With no scattered inputs a process's weight is the length of its sliceable
    variables, which a scatter or set_value changes: no kept share may keep it."""
    fork(2, master_rank=master_rank)
    S = pytensor.shared(np.zeros((3, 2)), name="S")
    f = synk.function([], [(S.sum(axis=0), "avg")], sliceable_shareds=[S], mode=MODE)
    synk.distribute()
    rng = np.random.default_rng(master_rank)
    for length in [3, 3, 5, 5, 2, 7, 7, 4]:
        f()  # (a call of the old lengths first: planned, kept)
        synk.scatter(S, rng.normal(size=(length, 2)))
        parts = [synk.get_value(r, S) for r in range(2)]
        for _ in range(2):
            got = f()[0]
            want = sum(len(p) * p.sum(axis=0) for p in parts) / sum(len(p) for p in parts)
            np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"lengths {[len(p) for p in parts]}")


class _RecordingPlan(CommPlan):
    """A communicator's plan that records its runs and does what an all_reduce of one
    process does (the values stay); ``refuse`` makes it say the values left it;
    ``keep_values=False`` records no reference to the values (a real plan keeps none)."""

    def __init__(self, layout, op, out_of_place=False, needs_exclusive=False, keep_values=True):
        self.layout, self.op = layout, op
        self.out_of_place, self.needs_exclusive, self.keep_values = out_of_place, needs_exclusive, keep_values
        self.runs, self.refuse = [], False

    def run(self, values, outs=None):
        s = runtime.running_session()
        self.runs.append((list(values) if self.keep_values else None, outs, s.in_flight))
        if self.refuse or tuple((v.dtype, v.shape) for v in values) != self.layout:
            return False
        if outs is not None:
            for v, o in zip(values, outs):
                assert o is not v and not np.shares_memory(o, v)
                o[...] = v
        return True


@pytest.fixture
def comm_plans(monkeypatch):
    """ShmCommunicator gives a recording plan (kept in the returned list), and no
    inline path: a fork of one process then keeps the communicator's plan."""
    made = []

    def plan(self, kind, layout, op, step=None, reducers=None):
        if reducers is not None:  # the inline path's plan: none, so every all_reduce takes the full path
            return None
        made.append(_RecordingPlan(layout, op, **options))
        made[-1].step = step
        return made[-1]

    options: dict = {}
    monkeypatch.setattr(ShmCommunicator, "plan", plan)
    return made, options


def _one_process_holding_v(fork):
    """A fork of one process, and a distributed function's shared variable ``v`` (0, 1, 2)."""
    fork(1)
    v = pytensor.shared(np.arange(3.0), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    return v


def _comm_plan_of(v):
    return next(p for key, p in _kept().plans.items() if key[:2] == ("all_reduce", id(v)))


def test_a_fork_of_one_process_keeps_the_communicator_s_plan_and_runs_it(fork, comm_plans):
    made, _ = comm_plans
    v = _one_process_holding_v(fork)
    synk.all_reduce(v, op="sum")  # the full path: the plan is made and kept
    assert len(made) == 1 and made[0].layout == ((np.dtype(float), (3,)),) and made[0].op == "sum"
    key, words = made[0].step  # what begin_step would number and check across nodes
    assert key[0] == "all_reduce" and "all_reduce([v], op='sum')" == words[0](*words[1:])
    commands, generation = _commands(), _kept().generation
    for _ in range(3):
        synk.all_reduce(v, op="sum")
    assert len(made[0].runs) == 3 and (_commands(), _kept().generation) == (commands, generation)
    assert all(vals[0] is v.container.storage[0] and outs is None and flight is not None
               for vals, outs, flight in made[0].runs)  # run as a command: in_flight set meanwhile
    assert runtime.running_session().in_flight is None
    assert_array_equal(v.get_value(), np.arange(3.0))


def test_the_communicator_s_plan_runs_only_when_the_fork_is_idle(fork, comm_plans):
    made, _ = comm_plans
    v = _one_process_holding_v(fork)
    synk.all_reduce(v, op="avg")
    plan = _comm_plan_of(v)
    s = runtime.running_session()
    s.in_flight = 1  # inside a command (a nested call): the full path, which refuses it
    try:
        assert plan.run() is False
    finally:
        s.in_flight = None
    synk.function([], 2 * v.sum(), mode=MODE)  # waits to be distributed: the full path distributes it
    synk.all_reduce(v, op="avg")
    assert made[0].runs == [] and len(made) == 2  # planned again after that full path
    synk.all_reduce(v, op="avg")
    assert len(made[1].runs) == 1


def test_a_plan_that_refuses_sends_the_full_path_which_plans_again(fork, comm_plans):
    made, _ = comm_plans
    v = _one_process_holding_v(fork)
    synk.all_reduce(v, op="max")
    v.set_value(np.arange(5.0))  # another shape: the plan says False, the full path runs
    commands = _commands()
    synk.all_reduce(v, op="max")
    assert len(made[0].runs) == 1 and _commands() == commands + 1
    assert len(made) == 2 and made[1].layout == ((np.dtype(float), (5,)),)
    synk.all_reduce(v, op="max")
    assert len(made[1].runs) == 1 and _commands() == commands + 1
    assert_array_equal(v.get_value(), np.arange(5.0))


def test_an_out_of_place_plan_gets_spare_homes_and_the_variable_takes_the_result(fork, comm_plans):
    made, options = comm_plans
    options["out_of_place"] = True
    fork(1)
    vs = [pytensor.shared(np.arange(4.0) + k, name=f"v{k}") for k in range(2)]
    synk.function([], vs[0].sum() + vs[1].sum(), mode=MODE)
    synk.distribute()
    synk.all_reduce(vs, op="sum")
    for rep in range(4):
        before, generation = [v.container.storage[0] for v in vs], _kept().generation
        synk.all_reduce(vs, op="sum")
        after = [v.container.storage[0] for v in vs]
        assert _kept().generation > generation  # variables hold other arrays now
        assert all(a is not b for a, b in zip(after, before)) and not np.shares_memory(after[0], after[1])
        for k, v in enumerate(vs):
            assert_array_equal(v.get_value(), np.arange(4.0) + k)
    assert len(made) == 1 and len(made[0].runs) == 4


def test_an_in_place_plan_is_refused_while_another_variable_holds_its_value(fork, comm_plans):
    made, options = comm_plans
    options["needs_exclusive"] = True
    fork(1)
    a = pytensor.shared(np.arange(3.0), name="a")
    b = pytensor.shared(np.zeros(3), name="b")
    synk.function([], a.sum() + b.sum(), mode=MODE)
    synk.distribute()
    synk.all_reduce(a, op="sum")
    synk.all_reduce(a, op="sum")
    assert len(made[0].runs) == 1
    b.set_value(a.get_value(borrow=True), borrow=True)  # b holds a's very array (as JAX's forwarding leaves it)
    synk.all_reduce(a, op="sum")
    assert len(made[0].runs) == 1  # refused: the full path ran
    b.set_value(np.zeros(3))
    synk.all_reduce(a, op="sum")
    assert sum(len(p.runs) for p in made) == 2
    synk.all_reduce([a, b], op="sum")  # the full path: a plan of both
    b.set_value(a.get_value(borrow=True), borrow=True)
    synk.all_reduce([a, b], op="sum")  # one array in two of the plan's own variables: refused as well
    assert made[-1].runs == []
    assert_array_equal(b.get_value(), np.arange(3.0))


def test_an_in_place_plan_finds_its_values_alone_without_scanning_every_variable(fork, comm_plans, monkeypatch):
    """The usual step of an in-place plan: each value referred to only by its variable,
    its home and the plan's list, told by reference counts; a scan of the fork's other
    variables only where something else refers to a value (and then the scan decides)."""
    made, options = comm_plans
    options.update(needs_exclusive=True, keep_values=False)
    fork(1)
    vs = [pytensor.shared(np.arange(3.0) + k, name=f"v{k}") for k in range(30)]
    a, b = vs[0], vs[1]
    step = synk.function([], pt.stack([v.sum() for v in vs]).sum(), updates=[(vs[2], vs[2] + 1)], mode=MODE)
    synk.distribute()
    verdicts = []
    held_alone = plans._held_alone
    monkeypatch.setattr(plans, "_held_alone", lambda values, homed: verdicts.append(held_alone(values, homed))
                        or verdicts[-1])
    for other_op, targets in (("max", [a, b]), ("min", a)):
        synk.all_reduce(targets, op="sum")  # the full path keeps the plan
        plan = made[-1]
        # (the shared-memory path keeps its last agreement, which refers to the values it reduced:
        # a full path of another variable moves it on; across nodes, the one real user of an
        # in-place plan of one process, MPI's full path keeps no such reference)
        synk.all_reduce(vs[29], op=other_op)
        verdicts.clear()
        for _ in range(3):
            synk.all_reduce(targets, op="sum")
            step()  # (a call in between: PyTensor's storage refers to its outputs, not to a or b)
        assert verdicts == [True] * 3 and len(plan.runs) == 3
    kept = a.get_value(borrow=True)  # a reference of the caller's: the scan runs, and finds no other variable
    synk.all_reduce(a, op="sum")
    assert verdicts[-1] is False and len(plan.runs) == 4
    vs[20].set_value(kept, borrow=True)  # another variable holds a's array: refused (the full path)
    synk.all_reduce(a, op="sum")
    assert len(plan.runs) == 4 and verdicts[-1] is False


def test_without_a_communicator_plan_nothing_is_kept(fork, monkeypatch):
    monkeypatch.setattr(ShmCommunicator, "plan", lambda self, kind, layout, op, step=None, reducers=None: None)
    v = _one_process_holding_v(fork)
    for _ in range(2):
        synk.all_reduce(v, op="sum")
    assert not [k for k in _kept().plans if k[0] == "all_reduce"]
    assert_array_equal(v.get_value(), np.arange(3.0))


@pytest.mark.skipif(not pytensor.config.cxx, reason="PyTensor's C linker needs a C++ compiler")
@pytest.mark.parametrize("dtype,char", [("int64", "q"), ("uint64", "Q")])
def test_a_planned_call_takes_a_longlong_array_as_the_first_call_does(fork, dtype, char):
    """np.longlong arrays compare equal to int64 ones but have another type number, which
    PyTensor's filter converts and its C code refuses: the planned call (no filter) took
    them as they were, and the second call of a loop raised "expected type_num 7 got 9"."""
    fork(2)
    x = pt.matrix("x", dtype=dtype)
    mode = pytensor.compile.mode.Mode(linker="cvm", optimizer="fast_compile")
    f = synk.function([x], [(pt.sum(x, axis=0), "sum"), (x * 2, "gather")], mode=mode)
    a = np.arange(12).reshape(6, 2).astype(char)
    assert a.dtype == np.dtype(dtype) and a.dtype.num != np.dtype(dtype).num
    want = f.as_pytensor(a)
    for _ in range(3):  # the first call is checked in full, the next ones planned
        got = f(a)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            assert_array_equal(g, w)
