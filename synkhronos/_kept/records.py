"""Kept state: the one owner, per process, of everything that lets a call or collective skip checks.

A loop of calls or small collectives repeats the previous one; what the
first one checked and prepared is kept, so that the next ones only check what
can have changed. Every such record of a process lives in that process's
:class:`Kept` (``proc.kept``, master and worker alike), in a :class:`Table`
(one capacity policy: the oldest record goes when a table is full), and is
used by one rule:

**The validity rule.** ``Kept.generation`` counts the events that can move
memory a record points into, change a value's shape or dtype, or give a
shared variable another array, in any process: every command the master
posts (calls, collectives, ``set_value``, ``scatter``, ``distribute``), a
``synk.data`` freed or resized, a failure, ``close()``. A record made or
verified under the current generation may be used as it is. A record of an
older generation is used only after it was verified again against the
state itself (a direct collective: the workers' home boards, where each
worker publishes the generation of the memory that holds each value; see
:mod:`synkhronos._kept.plans`), and then carries the current generation; a record
that cannot be verified is dropped and the full path runs, which may keep a
new one. Records that the master changes itself between commands (its own
shared variables, which user code may ``set_value`` at any time) are checked
at every use by identity, shape and dtype, never trusted by generation.

The tables, by side:

* master: ``resolved`` (shared-variable arguments resolved to their ids),
  ``bodies`` (pickled inline collective commands, with their layout and plan),
  ``plans`` (kept plans of small collectives, :mod:`synkhronos._kept.plans`),
  ``calls_of(fid)`` (a Function's planned calls, keyed by its inputs'
  shapes and data references; dropped by a full call of it, which may move
  the scratch memory they write into). A planned call of a process alone in
  its fork keeps its output reduction with it
  (:class:`~synkhronos._function.reduce.KeptReduction`): the communicator's
  reduce of the outputs' layout (NCCL's counts, datatypes and ops, one group),
  and per output which array type was found readable and writable whole. The
  outputs' shapes follow the shared values' shapes, which ``set_value`` and
  updates change at any call, so it is never trusted by generation: every use
  compares each output's dtype and shape with the kept layout, and one that
  differs drops it before anything is sent (the full reduction runs and keeps
  a new one). Also kept there: the ranges of the shared values' device arrays,
  by the very array (a weak reference; a device array's buffer never moves
  while it lives), rebuilt at every call. Never kept: which outputs may be
  written in place (an output may be an input, a shared value, an update's
  value or another output, differently at every call);
* worker: ``calls`` (a kept call message's spec, share and lane),
  ``worker_plans`` (a kept inline collective message's plan),
  ``published`` (the homes published on this worker's board: of its kept
  plans, and across nodes of its full-path small all_reduces, which its node
  master's direct plan reads);
* both: ``reducers`` (a :class:`~synkhronos.collectives.ops.Reducer` per
  op, dtype, shape and number of parts: a pure function of its key, valid
  for ever).

What is not here, and why: the control block's kept message bodies
(``ControlBlock.post``) are a protocol that master and workers keep in step
by one shared window, and the reply and inline areas' parsed layouts are
keyed by a version that the writer puts in the area's header with the data:
both are checked against shared memory at every use, so they cannot go
stale; they use :class:`Table` for their capacity. Nor is a node master's
kept exchange among nodes per layout, op and weight
(``NodeCommunicator._kept_middle``): a pure function of its key and of the
communicator it lives and dies with, whose every use compares every node's
header byte for byte. Nor are the resources a
process owns or maps (scratch segments, homes, slots, a ``synk.data``
mapping, which ``data.attach`` checks against the segment's name at every
use): they hold memory, they let nothing skip a check.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any, NamedTuple, TypeVar

__all__ = ["Table", "Mode", "Kept", "KeptCall", "Published", "InlineBody", "Resolved"]


_R = TypeVar("_R")


class Table(dict):
    """A dict of at most ``capacity`` records: adding one to a full table drops the oldest."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"a Table needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity

    def keep(self, key: Hashable, record: _R) -> _R:
        """Keep ``record`` under ``key`` (dropping the oldest record when full); return it."""
        if key not in self and len(self) >= self.capacity:
            del self[next(iter(self))]
        self[key] = record
        return record


class Mode(enum.IntEnum):
    """How a kept plan of a small collective may run now (:mod:`synkhronos._kept.plans`)."""

    FULL = 0      # not at all: the full path runs (and may plan again)
    COMMAND = 1   # by its command: the fork is idle, a worker's value is not where it was found
    DIRECT = 2    # by the master alone: every worker's value still where the plan found it


class KeptCall(NamedTuple):
    """A worker's kept call message: the very message object, its spec, share and lane."""

    wire: tuple
    call: Any
    share: Any
    lane: Any


class Published(NamedTuple):
    """A home a worker published on its board: the variable, the array, its shape, its generation."""

    var: Any
    home: Any
    shape: tuple
    generation: int


class InlineBody(NamedTuple):
    """A pickled inline collective command, the layout of the values it was made for,
    and the communicator's plan of it (:class:`~synkhronos.collectives.shm_plans.InlinePlan`)."""

    body: bytes
    layout: tuple
    plan: Any


class Resolved(NamedTuple):
    """A shared-variable argument resolved: the variables, their ids, whether it was one bare variable."""

    items: list
    sids: list
    single: bool


#: Capacities (records per table).
RESOLVED = 256
BODIES = 256
PLANS = 64
CALLS = 64
CALL_PLANS = 8      # per Function: input shapes seen lately
WORKER_PLANS = 64
PUBLISHED = 16      # a worker checks each before every answer (about 0.15 us each)
REDUCERS = 256


class Kept:
    """Every record of one process that lets a call or collective skip checks (see above)."""

    def __init__(self) -> None:
        self.generation = 1
        self.resolved = Table(RESOLVED)
        self.bodies = Table(BODIES)
        self.plans = Table(PLANS)
        self.calls = Table(CALLS)
        self.worker_plans = Table(WORKER_PLANS)
        self.published = Table(PUBLISHED)
        self.reducers = Table(REDUCERS)
        self._call_plans: dict[int, Table] = {}

    def moved(self) -> int:
        """Something may have moved (see the validity rule): a new generation; returns it."""
        self.generation += 1
        return self.generation

    def calls_of(self, fid: int) -> Table:
        """The planned calls of Function ``fid`` (master)."""
        table = self._call_plans.get(fid)
        if table is None:
            table = self._call_plans[fid] = Table(CALL_PLANS)
        return table

    def forget_calls(self) -> None:
        """Drop every kept call (a worker, when the master dropped a synk.data mapping they may view)."""
        self.calls.clear()

    def clear(self) -> None:
        """Drop every record (close(), a fork that broke): records hold views of shared memory."""
        self.moved()
        for table in (self.resolved, self.bodies, self.plans, self.calls, self.worker_plans,
                      self.published, self.reducers, *self._call_plans.values()):
            table.clear()
