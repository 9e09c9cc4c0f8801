"""The shared-memory communicator's plans of the small collectives of one fork.

A broadcast, all_reduce, gather or reduce of values that fit the inline areas
(:mod:`synkhronos.collectives.inline`) is one command round trip: every
process writes its values into its own area (:meth:`InlinePlan.post`: the
master before it posts the command, a worker once it has it), then takes its
half (:meth:`InlinePlan.run`: an all_reduce's processes each combine every
process's values, in rank order, with the Reducer of ``ops.combine``: the same
bits everywhere; a broadcast's workers copy the master's values), and the
master reads the workers' areas once they answered (:meth:`InlinePlan.parts`).
With more than two processes an all_reduce's workers also wait for each
other's values (the master releases them once every one arrived).

Between commands the master may run the whole collective itself
(:meth:`InlinePlan.find_peers`, then :class:`PeerHomes`): every worker publishes on
its home board where its values live (``ShmCommunicator.publish_home``); a
plan that found every worker's home reads and writes them in place, and
:meth:`PeerHomes.hold` says whether every board still shows them. When
it may (the fork idle, every worker's values where they were) is the kept
plans' rule, :mod:`synkhronos._kept.plans`; this module does what the shared
memory does.
"""

from __future__ import annotations

import typing

import numpy as np

from .base import CommPlan
from .inline import fold_into, raise_mismatch, reducers_for
from .ops import cast_to, kept_reducer

__all__ = ["InlinePlan", "PeerHomes", "INLINE_KINDS"]

#: The collectives that take the inline channel.
INLINE_KINDS = frozenset(("broadcast", "all_reduce", "gather", "reduce"))


class InlinePlan(CommPlan):
    """``kind`` on values of ``layout`` (per value ``(dtype, shape)``) within one
    fork, through the inline areas and the home boards (see above); made by
    ``ShmCommunicator.plan``. ``layout`` None: a worker's plan of whatever values
    it holds now (they may not fit, or differ from the master's: its area then
    says so, and the master raises), or of whatever the master posted (a
    broadcast, :meth:`receive`)."""

    __slots__ = ("comm", "kind", "layout", "op", "reducers", "casts", "cache")

    def __init__(self, comm, kind: str, layout, op, reducers):
        self.comm, self.kind, self.layout, self.op, self.cache = comm, kind, layout, op, reducers
        self.reducers, self.casts = (None, None)
        if kind == "all_reduce" and layout is not None:
            self.reducers, self.casts = reducers_for(comm.size, reducers, op, layout)

    # -- one command round trip ----------------------------------------------

    def post(self, values) -> None:
        """This process's ``values`` (of the plan's layout) into its area, for the
        others: the master's before it posts the command (broadcast, all_reduce),
        a worker's before its half (all_reduce) or its answer (gather, reduce)."""
        self.comm.put_inline(values, self.layout)

    def run(self, values, outs=None) -> bool:
        """This process's half, once every process posted (the master: once the
        command is out). all_reduce: every process's values combined into ``outs``
        (default ``values``: where every value is written in place); a broadcast's
        worker: the master's values copied into ``values``. False, having changed
        nothing, when some process's values have another layout (the master then
        raises, :meth:`mismatch`; a worker goes on)."""
        comm = self.comm
        if self.kind == "broadcast":
            srcs = comm.inline_values(comm.master_rank)
            if len(srcs) != len(values):
                return False
            for src, home in zip(srcs, values):
                if src.dtype is not home.dtype or src.shape != home.shape:
                    return False
            for src, home in zip(srcs, values):
                np.copyto(home, src)
            return True
        if comm.rank == comm.master_rank:
            comm.inline_await()
        else:
            comm.inline_arrive()
        layout, reducers, casts = self.layout, self.reducers, self.casts
        if layout is None:  # (a worker's values as they are)
            layout = tuple((v.dtype, v.shape) for v in values)
        parts = comm.inline_parts(values, layout)
        if parts is None:
            return False
        if reducers is None:
            reducers, casts = reducers_for(comm.size, self.cache, self.op, layout)
        if outs is None:
            outs = values
        elif any(o is not v for o, v in zip(outs, values)):
            # a value moved into its home since it was posted: the move may have overwritten
            # another of ``values`` (a call that swapped two variables left one holding the
            # other's home), so this process's part is read from its area, which holds them as posted
            parts[comm.rank] = comm.inline_values(comm.rank)
        fold_into(outs, parts, reducers, casts)
        return True

    def receive(self, receive) -> None:
        """A broadcast's worker: each of the master's values, ``receive(i, view)``
        (a view of the master's area: copy it)."""
        comm = self.comm
        for i, src in enumerate(comm.inline_values(comm.master_rank)):
            receive(i, src)

    def parts(self, own, same: bool = True):
        """The master, once every worker answered: per rank its values (``own`` for
        its own; views of their areas), or None when a worker's did not fit its
        area or, with ``same``, have another layout than the plan's."""
        return self.comm.inline_parts(own, self.layout if same else None)

    def mismatch(self) -> typing.NoReturn:
        """Raise the error of processes whose values differ in layout, naming them."""
        raise_mismatch(self.comm, self.layout, self.op)

    # -- the master alone, between commands ----------------------------------

    def find_peers(self, slots, own, peer_layouts=None) -> PeerHomes | None:
        """Every worker's values of ``slots`` (the variables' ids), found on their
        home boards: of the plan's dtypes and shapes, or of ``peer_layouts[rank]``
        (a gather's, whose shapes may differ per rank); ``own``: this process's
        values now, which the direct path reads (and an all_reduce writes) in
        place. None when some worker published none."""
        comm = self.comm
        if not all(slot < comm.home_slots for slot in slots):
            return None
        peers, views = [], {}
        for r in range(comm.size):
            if r == comm.rank:
                continue
            board = comm.home_board(r)
            layout = self.layout if peer_layouts is None else peer_layouts[r]
            for slot, (dtype, shape) in zip(slots, layout):
                view = comm.peer_home(r, slot, board[slot], dtype, shape)
                if view is None:
                    return None
                peers.append((board, slot, board[slot]))
                views[r, slot] = view
        mine = dict(zip(slots, own))
        parts = [[mine[slot] if r == comm.rank else views[r, slot] for r in range(comm.size)] for slot in slots]
        outs = [[views[r, slot] for r in range(comm.size) if r != comm.rank] for slot in slots]
        return PeerHomes(self, peers, list(own), parts, outs)


class PeerHomes:
    """Every process's values of one plan, where they live, found by
    :meth:`InlinePlan.find_peers`: the master reads (and writes) them in place."""

    __slots__ = ("plan", "peers", "own", "parts", "outs", "scalars")

    def __init__(self, plan: InlinePlan, peers, own, parts, outs):
        self.plan, self.peers, self.own, self.parts, self.outs = plan, peers, own, parts, outs
        self.scalars = None  # every value one element: per value (Reducer, 0-d views of all homes)
        if plan.kind == "all_reduce":
            self.scalars = _as_scalars(plan.cache, plan.op, parts, plan.casts)

    def hold(self) -> bool:
        """Whether every worker's board still shows the homes found (a generation
        names one memory, dtype and shape of a process)."""
        for board, slot, gen in self.peers:
            if board[slot] != gen:
                return False
        return True

    def all_reduce(self) -> None:
        """Every process's values combined, in rank order, into every process's home
        (this process's: the values ``find_peers`` was given)."""
        if self.scalars is not None:
            for reducer, views in self.scalars:
                value = reducer.scalar(views)  # every view read before any is written
                for view in views:
                    view[()] = value
            return
        plan = self.plan
        reducers, casts = typing.cast(list, plan.reducers), typing.cast(list, plan.casts)
        for i, (home, parts, outs) in enumerate(zip(self.own, self.parts, self.outs)):
            if casts[i] or parts[0] is not home:
                np.copyto(home, cast_to(reducers[i].run(parts), home.dtype))
            else:  # into the first part itself: every later part is another process's memory
                reducers[i](parts, out=home)
            for dst in outs:
                dst[...] = home

    def broadcast(self, values) -> None:
        """``values`` (of the plan's layout) into every worker's home."""
        for value, outs in zip(values, self.outs):
            for dst in outs:
                dst[...] = value

    def values(self, values) -> list:
        """Per value, every process's value in rank order, ``values`` for this
        process's (read in place: a gather joins them, a reduce combines them)."""
        me, got = self.plan.comm.rank, []
        for value, parts in zip(values, self.parts):
            parts = list(parts)
            parts[me] = value
            got.append(parts)
        return got


def _as_scalars(cache, op, parts, casts):
    """For a direct all_reduce whose values all have one element (of dtypes whose
    result needs no cast): per value, its Reducer and 0-d views of every process's
    home, which the Reducer combines as numpy scalars, with the same bits as ufunc
    calls in a fraction of their time (see :class:`~synkhronos.collectives.ops.Reducer`); else None."""
    got = []
    for value_parts, cast in zip(parts, casts):
        if cast or value_parts[0].size != 1:
            return None
        views = [p.reshape(()) for p in value_parts]  # views: the same memory
        reducer = kept_reducer(cache, op, views)
        if not reducer.scalar_path:
            return None
        got.append((reducer, views))
    return got
