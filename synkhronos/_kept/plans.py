"""Kept plans of small broadcast, all_reduce, gather and reduce, and the direct path that runs them without a command.

Kept plans: a loop of the same small collective. Once one went through by
the inline path, its plan is kept: in the master per argument (the
variables, op and nccl as the caller gave them), in a worker per kept
message. The next one checks only what can have changed since: that the fork
is idle and has no new function to distribute, and that each variable still
holds the very array the plan holds (all_reduce writes its result into it;
a broadcast's master values need only the plan's dtypes and shapes). Anything
else takes the full path, which plans again.

Direct: a worker's values change only while it runs a command. A worker
that kept a plan publishes on its home board, before every answer, whether
each variable of it still holds that home (ShmCommunicator.publish_home).
The master records the generations published right after a round trip that
found every process's values of the plan's dtypes and shapes; while every
worker is idle and publishes the same ones, the same arrays still are the
values, so the master does the whole collective itself, with no command: it
reads every process's value where it lives, reduces them with the same
Reducer, in rank order, and writes the result (or, for a broadcast, its
values) into every process's home. The workers find them there at their
next command. Liveness is checked as often as a waiting master checks it.
Once a plan found the fork so, nothing can move until the master posts a
command: while the generation of the master's kept records
(``proc.kept.generation``, which every posted command moves: the validity
rule of :mod:`synkhronos._kept.records`) is the one it verified under, the next direct
run checks only the session's state and liveness (``_Plan._mode``); under a
newer one it verifies the workers' boards again.

A gather or reduce changes no worker's value: its plan runs only directly
(the master joins, or reduces with the inline path's Reducer in rank order,
every process's value, read where it lives, into new arrays; an in-place
reduce then stores them in the master's variables); when it cannot, the full
path runs the command. A worker's inline gather or reduce moves its values
into their homes first (once; again after an update moved them), so that
they can be published.

A communicator's own plan: in a fork of one process (a node of one process
across nodes, one GPU), an all_reduce (across nodes also a broadcast or a
reduce) that went through by the full path asks the communicator for a
:class:`~synkhronos.collectives.base.CommPlan` (:func:`keep_comm_plan`): what
the collective does, agreed once among the processes it reaches (the other
nodes, NCCL's ranks). The next one of the same argument runs it, with no
command (there are no workers), while the fork is idle with nothing to
distribute; the plan itself checks that the values still have its layout
(else the full path runs, and plans again), and each run carries its
fingerprint, which every process compares. A broadcast's plan writes node 0's
values into this node's in place, or hands them over as new arrays where the
step went the long way (another node on the full path with another layout);
a reduce's is the all_reduce's exchange among node masters, into new arrays.

The master's half: ``_shareds.api.broadcast`` and ``.all_reduce`` try
:func:`planned` first, ``.gather`` :func:`planned_gather`, ``.reduce``
:func:`planned_reduce`, and the
inline path keeps a plan with :func:`keep_plan`.
The worker's half: ``_shareds.host.worker_collective`` keeps a plan with
:func:`keep_worker_plan`, and ``worker.loop.serve`` calls :func:`publish_homes`
before every answer.
"""

from __future__ import annotations

import sys
import typing

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable

from .. import _state as state
from .._arrays import join
from ..collectives.inline import reduced
from ..collectives.mpi_wire import INLINE_BYTES
from .._protocol.control import Command
from .._shareds.homes import is_first_home
from .records import Mode, Published

__all__ = ["PLANNED_KINDS", "planned", "planned_gather", "planned_reduce", "resolve_key", "keep_plan",
           "keep_comm_plan", "keep_node_plan", "keep_worker_plan", "publish_node_homes", "publish_homes"]

#: The inline collectives that keep plans.
PLANNED_KINDS = frozenset(("broadcast", "all_reduce", "gather", "reduce"))
#: The most bytes of a node's values that a node of several processes plans (the MPI
#: header slot's inline values, :data:`synkhronos.collectives.mpi_wire.INLINE_BYTES`).
NODE_PLAN_BYTES = INLINE_BYTES
#: The kinds whose plans run only directly: they read values and change no worker's.
_READ_KINDS = frozenset(("gather", "reduce"))
#: (module globals: a direct run, about 1.7 us in all, looks each up once)
_FULL, _COMMAND, _DIRECT = Mode.FULL, Mode.COMMAND, Mode.DIRECT


def planned(kind, shared_vars, op, nccl) -> bool:
    """Run the master's kept plan of this collective, if there is one and it still
    holds; False when the full path must run (no plan, or it no longer holds, or
    a command is running in this thread: the full path refuses the nested call)."""
    plan = _kept(kind, shared_vars, op, nccl)
    return plan is not None and plan.run()


def planned_gather(shared_vars, nd_up, nccl):
    """The master's kept plan of this gather, run directly: the gathered values
    (new arrays, one per variable), or None when the full path must run."""
    if type(nd_up) is not int:  # (True == 1: only what the full path accepts may hit)
        return None
    plan = _kept("gather", shared_vars, nd_up, nccl)
    return None if plan is None else plan.run()


def planned_reduce(shared_vars, op, in_place, nccl):
    """The master's kept plan of this reduce, run directly: the results (new
    arrays in the variables' dtypes, one per variable; the caller stores them
    when ``in_place``), or None when the full path must run."""
    if type(op) is not str:  # (an unhashable op must reach the full path's check)
        return None
    plan = _kept("reduce", shared_vars, (op, bool(in_place)), nccl)
    return None if plan is None else plan.run()


def _kept(kind, shared_vars, op, nccl):
    """The master's kept plan for these arguments, or None."""
    s = state.current()
    if s is None or (nccl is not True and nccl is not False):  # (1 == True: only a bool may hit)
        return None
    # a plan keeps its variables alive: a hit on id(shared_vars) is that very variable
    plans = s.kept.plans
    plan = plans.get((kind, id(shared_vars), op, nccl))
    if plan is None and type(shared_vars) in (list, tuple):
        plan = plans.get((kind, resolve_key(shared_vars), op, nccl))
    return plan


def resolve_key(shared_vars):
    """The key of ``_shareds.api._resolve``'s cache for this argument: a variable's id,
    a tuple of ids for a list or tuple of them; None for anything else."""
    if isinstance(shared_vars, SharedVariable):
        return id(shared_vars)
    if type(shared_vars) in (list, tuple):
        return tuple(map(id, shared_vars))
    return None


def keep_plan(s, plan_key, kind, vars_, cplan, op, wire, body, peer_layouts=None) -> None:
    """Keep the plan of the collective that just went through by the inline path (its
    communicator's plan ``cplan``, of the master's values' layout), under ``plan_key``;
    ``peer_layouts`` (per rank, the layout of its values) where the workers' values
    may differ in shape from the master's (a gather), else every rank has the same."""
    if plan_key is None or plan_key[1] is None:
        return
    homes = [v.container.storage[0] for v in vars_]
    if tuple((getattr(h, "dtype", None), getattr(h, "shape", None)) for h in homes) != cplan.layout:
        return  # (a variable whose value is not the array that was sent: never planned)
    plans = s.kept.plans
    plan = plans.keep(plan_key, _CLASSES[kind](s, kind, vars_, homes, cplan, op, wire, body))
    plan.find_homes(peer_layouts)
    if kind in _READ_KINDS and plan.found is None:  # (it runs only directly)
        del plans[plan_key]


class _Plan:
    """The master's kept plan of one inline broadcast, all_reduce, gather or reduce (see above)."""

    __slots__ = ("s", "kind", "vars_", "held", "homes", "cplan", "op", "wire", "body", "found", "verified")

    def __init__(self, s, kind, vars_, homes, cplan, op, wire, body):
        self.s, self.kind, self.vars_, self.homes, self.cplan = s, kind, list(vars_), homes, cplan
        self.held = _held(vars_, homes, cplan.layout)
        self.op, self.wire, self.body = op, wire, body
        self.found: typing.Any = None  # direct: every process's values where they live (PeerHomes), once found
        self.verified = None  # direct: the kept generation when the fork was last found idle, every value home

    def run(self) -> bool:  # (a method of each kind's class: a bound method kept here would be a cycle)
        """The collective; False, having done nothing, when the plan no longer holds."""
        raise NotImplementedError

    def find_homes(self, peer_layouts=None) -> None:
        """After a round trip that went well: where every worker's values live now, if
        every one published them. They are of the plan's dtypes and shapes, or of
        ``peer_layouts[rank]`` when given (a gather's, whose shapes may differ per
        rank); a generation names one memory, dtype and shape of a process, so the
        same generation on the board later is the same value of that layout."""
        self.verified = None
        self.found = self.cplan.find_peers(self.wire[2], self.homes, peer_layouts)

    def _mode(self) -> Mode:
        """How the plan may run now (:class:`~synkhronos._kept.records.Mode`). Raises if a worker died.

        The validity rule (:mod:`synkhronos._kept.records`): a worker's values move only
        while it runs a command, and every command moves the kept generation.
        Verified under the current generation, the plan runs directly after a
        check of the session's state and the workers' liveness; under an older
        one, only once every worker's board shows the homes the plan found
        (each generation there names one memory, dtype and shape)."""
        s = self.s
        if len(s.distributed) != len(s.proc.functions):
            return _FULL
        generation = s.kept.generation
        if generation == self.verified and s.in_flight is None and s.broken is None and not s.close_requested:
            s.check_alive()
            return _DIRECT
        if not s.idle():
            return _FULL
        found = self.found
        if found is None or not found.hold():
            return _COMMAND
        s.check_alive()
        self.verified = generation
        return _DIRECT


class _AllReducePlan(_Plan):
    """A kept all_reduce: each variable must still hold the plan's very array."""

    __slots__ = ()

    def run(self) -> bool:
        mode = self._mode()
        if not mode or not _still_held(self.held):
            return False
        if mode is _DIRECT:
            self.found.all_reduce()  # (direct: find_homes found them)
            return True
        homes, cplan = self.homes, self.cplan
        cplan.post(homes)
        # the master combines while the workers do: its half runs between post and collect
        if not self.s.run(Command.COLLECTIVE, self.wire, lambda p, _: cplan.run(homes), body=self.body):
            cplan.mismatch()
        self.find_homes()
        return True


class _BroadcastPlan(_Plan):
    """A kept broadcast of the master's values: they need only the plan's dtypes and shapes."""

    __slots__ = ()

    def run(self) -> bool:
        mode = self._mode()
        values = _current_values(self.held) if mode else None
        if values is None:
            return False
        if mode is _DIRECT:
            self.found.broadcast(values)  # (direct: find_homes found them)
            return True
        self.cplan.post(values)
        self.s.run(Command.COLLECTIVE, self.wire, body=self.body)
        self.find_homes()
        return True


class _ReadPlan(_Plan):
    """A kept gather (``op`` holds ``nd_up``) or reduce (``op`` holds the op's name,
    without a ``c_``): the master's values need only the plan's dtypes and
    shapes; it runs only directly."""

    __slots__ = ()

    def run(self):
        """The gathered or reduced values, in new memory; None, having done nothing,
        when the plan cannot run directly (the full path runs the command)."""
        if self._mode() is not _DIRECT:
            return None
        values = _current_values(self.held)
        if values is None:
            return None
        proc, gather = self.s.proc, self.kind == "gather"
        got = []
        # every process's value, read where it lives (the master's: its value now)
        for parts, var in zip(self.found.values(values), self.vars_):  # (direct: find_homes found them)
            if gather:
                got.append(join(parts, self.op, var))
            else:  # the inline path's reduce (_shareds.host._inline_reduce), in rank order
                got.append(reduced(proc, self.op, parts, var.type.dtype))
        return got


class _CommPlan:
    """A kept all_reduce or broadcast of a fork of one process, run by the communicator's
    :class:`~synkhronos.collectives.base.CommPlan` (see above)."""

    __slots__ = ("s", "kind", "vars_", "sids", "storages", "layout", "cplan", "spare", "receive", "others")

    def __init__(self, s, kind, vars_, sids, layout, cplan, spare, receive):
        self.s, self.kind, self.vars_, self.sids, self.layout = s, kind, list(vars_), list(sids), layout
        self.storages = [v.container.storage for v in vars_]  # (a Container keeps its own for life)
        self.cplan, self.spare, self.receive = cplan, spare, receive
        self.others: tuple = (-1, [])  # (len(proc.shareds), the other variables' storage lists)

    def _may_run(self) -> bool:
        """Whether the fork is idle with nothing to distribute (else the full path runs)."""
        s = self.s
        return len(s.distributed) == len(s.proc.functions) and s.idle()

    def run(self) -> bool:
        s = self.s
        if not self._may_run():
            return False
        values = [storage[0] for storage in self.storages]
        cplan = self.cplan
        if cplan.needs_exclusive and self._held_elsewhere(values, s.proc.shareds):
            return False
        outs = None
        if cplan.out_of_place:
            for value, (dtype, shape) in zip(values, self.layout):
                if type(value) is not np.ndarray or value.dtype is not dtype or value.shape != shape:
                    return False
            outs = [self.spare(sid, value) for sid, value in zip(self.sids, values)]
        elif self.kind == "broadcast":  # (root's values as new arrays, where the step went the long way)
            outs = [None] * len(values)
        return s.step_alone(self.kind, self._step, values, outs)

    def _step(self, values, outs) -> bool:
        done = self.cplan.run(values, outs)
        if not done or outs is None or all(out is None for out in outs):  # (results in the values)
            return done
        for sid, storage, out in zip(self.sids, self.storages, outs):
            if self.cplan.out_of_place:  # (a spare home, swapped in)
                storage[0] = out
            else:  # (a broadcast's values that went the long way)
                self.receive(sid, out)
        self.s.kept.moved()  # variables hold other arrays (the validity rule)
        return done

    def _held_elsewhere(self, values, shareds) -> bool:
        """Whether two of ``values`` are one array, or another shared variable of the
        fork (``shareds``) holds one of them (JAX forwards inputs to outputs: after
        ``updates=[(b, a)]`` b may hold a's very array); an in-place plan would
        then change that variable too.

        Past :data:`_SCAN_MOST` other variables, values that nothing but ``values``,
        their variables' storage and their homes refer to (:func:`_held_alone`) are
        held by no other variable: the usual step checks that alone, whatever the
        number of variables (a scan of a fork's 1,000 took 37-47 us a step); any other
        reference (a caller's, PyTensor's output storage after a call) sends them to
        the scan."""
        count, others = self.others
        if count != len(shareds):  # (variables come only with distribute)
            mine = set(self.sids)
            others = [var.container.storage for sid, var in shareds.items() if sid not in mine]
            self.others = (len(shareds), others)
        if len(others) > _SCAN_MOST:
            proc = self.s.proc
            if _held_alone(values, [is_first_home(proc, sid, values[i]) for i, sid in enumerate(self.sids)]):
                return False
        if len(values) == 1:  # (the usual case: no set to build)
            value = values[0]
            for storage in others:
                if storage[0] is value:
                    return True
            return False
        ids = {id(v) for v in values}
        if len(ids) != len(values):
            return True
        for storage in others:
            if id(storage[0]) in ids:
                return True
        return False


#: The most other variables an in-place plan scans at every step (a scan of a few costs
#: less than the reference counts' check, ~1 us a value)
_SCAN_MOST = 16


def _refs(values, i: int) -> int:
    """References to ``values[i]``, this call's among them."""
    return sys.getrefcount(values[i])


#: ``_refs`` of an array that one list alone refers to: measured, not assumed (what
#: getrefcount counts differs between Python versions)
_ONE_LIST_REFS = _refs([np.empty(0)], 0)


def _held_alone(values, homed) -> bool:
    """Whether each of ``values`` has no reference but ``values``'s, its variable's
    storage list's and, where ``homed[i]``, its home's (the communicator's resident
    array): then no other variable's storage holds it, nor does ``values`` twice."""
    for i, home in enumerate(homed):
        if _refs(values, i) > _ONE_LIST_REFS + 1 + home:
            return False
    return True


class _CommReducePlan(_CommPlan):
    """A kept reduce of a fork of one process across nodes, run by the communicator's
    all-reduce plan among the node masters (the result on every node master, as the
    full path's) into new arrays: the results, which the caller stores when in place."""

    __slots__ = ()

    def run(self):
        """The results (new arrays, one per variable), or None when the full path must run."""
        if not self._may_run():
            return None
        values = [storage[0] for storage in self.storages]
        outs = [np.empty(shape, dtype) for dtype, shape in self.layout]
        return outs if self.s.step_alone("reduce", self.cplan.run, values, outs) else None


def keep_comm_plan(s, plan_key, kind, vars_, sids, op, comm, step, spare=None, receive=None) -> None:
    """After a full-path all_reduce, broadcast or reduce (``kind``) in a fork of one process:
    keep ``comm``'s plan of it under ``plan_key`` (``Communicator.plan``; none: nothing
    kept), unless an inline plan holds that key. ``step``: its step key and words across
    nodes; ``spare(sid, value)``: an all_reduce's, an array for an out-of-place plan's result; ``receive(sid,
    value)``: a broadcast's, places ``value`` (new memory) as variable ``sid``'s. A reduce
    (across nodes only: its result on every node master) runs an all-reduce plan among
    the node masters."""
    plans = s.kept.plans
    have = plans.get(plan_key)
    if have is not None and type(have) not in (_CommPlan, _CommReducePlan):
        return
    values = [v.container.storage[0] for v in vars_]
    layout = tuple((getattr(a, "dtype", None), getattr(a, "shape", None)) for a in values)
    cplan = comm.plan("all_reduce" if kind == "reduce" else kind, layout, op, step)
    if cplan is None:
        plans.pop(plan_key, None)
        return
    plans.keep(plan_key, (_CommReducePlan if kind == "reduce" else _CommPlan)(
        s, kind, vars_, sids, layout, cplan, spare, receive))


class _NodeAllReducePlan(_Plan):
    """A node master's kept all_reduce in a node of several processes across nodes
    (:class:`~synkhronos.collectives.hier_plans.NodePlan`): it runs only directly,
    under the same rule as a fork's direct path (the fork idle, every worker's
    values in the homes found; see above); else the full path runs the command,
    and keeps the plan again. The step among nodes is numbered by the plan's
    exchange itself, before anything can fail."""

    __slots__ = ()

    def run(self) -> bool:
        if not _still_held(self.held) or self._mode() is not _DIRECT:
            return False
        return self.s.step_alone("all_reduce", self.found.all_reduce)  # (direct: find_homes found them)


def keep_node_plan(s, plan_key, vars_, sids, op, comm, step) -> None:
    """After a full-path all_reduce in the master of a node of several processes across
    nodes: keep ``comm``'s plan of it under ``plan_key`` when it can run directly
    (every worker published its values' homes), else keep none. ``step``: its step
    key and words across nodes, as for :func:`keep_comm_plan`."""
    plans = s.kept.plans
    have = plans.get(plan_key)
    if have is not None and type(have) is not _NodeAllReducePlan:
        return
    homes = [v.container.storage[0] for v in vars_]
    if have is not None and _still_held(have.held):  # (the usual case: the full path ran because a
        # value was set, and left it in the same home): the plan stands, with the homes found again
        # unless every worker's board still shows them
        if have.found is None or not have.found.hold():
            have.find_homes()
        if have.found is None:
            del plans[plan_key]
        return
    plans.pop(plan_key, None)
    if not _node_plannable(homes):
        return
    layout = tuple((h.dtype, h.shape) for h in homes)
    # the communicator's plan is a pure function of the key (variables, op: the step's key) and
    # the layout: the one kept serves again (a value set before each step would make it anew)
    cplan = have.cplan if have is not None and have.cplan.layout == layout else \
        comm.plan("all_reduce", layout, op, step, reducers=s.proc.kept.reducers)
    if cplan is None:
        return
    wire = (None, "all_reduce", tuple(sids), op)  # (find_homes reads the variables' ids there)
    plan = plans.keep(plan_key, _NodeAllReducePlan(s, "all_reduce", vars_, homes, cplan, op, wire, None))
    plan.find_homes()
    if plan.found is None:
        del plans[plan_key]


_CLASSES = {"all_reduce": _AllReducePlan, "broadcast": _BroadcastPlan, "gather": _ReadPlan, "reduce": _ReadPlan}


def _current_values(held):
    """The master's values of a plan's variables (``_held``) when they have the
    plan's dtypes and shapes (what a broadcast or gather needs); else None."""
    values = []
    for storage, _, dtype, shape in held:
        value = storage[0]
        if type(value) is not np.ndarray or value.dtype is not dtype or value.shape != shape:
            return None
        values.append(value)
    return values


def _held(vars_, homes, layout) -> list:
    """Per variable of a plan: its storage list (a Container keeps its own for
    life), the plan's array, its dtype and shape; see :func:`_still_held`."""
    return [(v.container.storage, h, dtype, shape) for v, h, (dtype, shape) in zip(vars_, homes, layout)]


def _still_held(held) -> bool:
    """Whether each variable still holds the very array of a plan (``_held``), of its shape."""
    for storage, home, _, shape in held:
        if storage[0] is not home or home.shape != shape:
            return False
    return True


def keep_worker_plan(proc, wire) -> None:
    """Keep the plan of the message ``wire`` that just ran by the full path,
    and publish where its values live (see :func:`publish_homes`)."""
    kind, sids, op = wire[1:]
    vars_ = [proc.shareds[sid] for sid in sids]
    homes = [v.container.storage[0] for v in vars_]
    if any(type(h) is not np.ndarray for h in homes):
        return
    comm = proc.comm
    cplan = comm.plan(kind, tuple((h.dtype, h.shape) for h in homes), op, reducers=proc.kept.reducers)
    if cplan is None:
        return
    proc.kept.worker_plans.keep(id(wire), _WorkerPlan(wire, kind, vars_, homes, cplan))
    _publish(proc, sids, vars_, homes)


def publish_node_homes(proc, sids) -> None:
    """A worker of a node of several processes, after a full-path all_reduce of small
    host values (at most :data:`NODE_PLAN_BYTES`): publish where they live, for the node master's
    direct path (:class:`_NodeAllReducePlan`)."""
    vars_ = [proc.shareds[sid] for sid in sids]
    homes = [v.container.storage[0] for v in vars_]
    if _node_plannable(homes):
        _publish(proc, sids, vars_, homes)


def _node_plannable(homes) -> bool:
    """Whether a node of several processes plans an all_reduce of ``homes`` (host arrays of
    at most :data:`NODE_PLAN_BYTES` in all): the node master keeps a plan, the workers publish."""
    return all(type(h) is np.ndarray for h in homes) and sum(h.nbytes for h in homes) <= NODE_PLAN_BYTES


def _publish(proc, sids, vars_, homes) -> None:
    """Publish the homes of these variables on this worker's home board (see :func:`publish_homes`)."""
    comm, published = proc.comm, proc.kept.published
    # (never evicted: a record dropped while its board entry stays would leave the entry stale;
    # once the table is full, the other variables' collectives take the command path)
    for sid, var, home in zip(sids, vars_, homes):
        if sid < comm.home_slots and (sid in published or len(published) < published.capacity):
            published[sid] = Published(var, home, home.shape, comm.publish_home(sid, home))


class _WorkerPlan:
    """A worker's kept plan of one inline broadcast, all_reduce, gather or reduce message (see above)."""

    __slots__ = ("wire", "kind", "held", "homes", "cplan")

    def __init__(self, wire, kind, vars_, homes, cplan):
        self.wire, self.kind, self.homes, self.cplan = wire, kind, homes, cplan
        self.held = _held(vars_, homes, cplan.layout)

    def run(self, proc) -> bool:
        """Run the plan; False, having done nothing, when it no longer holds."""
        homes = self.homes
        if not _still_held(self.held):
            return False
        kind, cplan = self.kind, self.cplan
        if kind == "broadcast":
            return cplan.run(homes)  # (False: the master's values have another layout)
        cplan.post(homes)  # a gather's or reduce's half: its values into its area
        if kind == "all_reduce":
            cplan.run(homes)  # (values of another layout change nothing: the master raises, naming them)
        return True


def publish_homes(proc) -> None:
    """A worker, before every answer: for each variable whose home it published,
    whether it still holds that home (its generation, or 0)."""
    published = proc.kept.published
    if not published:
        return
    board = proc.comm.home_board(proc.rank)
    for sid, (var, home, shape, gen) in published.items():
        board[sid] = gen if var.container.storage[0] is home and home.shape == shape else 0
