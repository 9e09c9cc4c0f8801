"""A collective on shared variables in every process: its specification, the
command, the inline path for small values, and the host path through the
shared-memory communicator (a GPU device runs its own, falling back to this one)."""

from __future__ import annotations

import dataclasses
import math
import pickle
import typing
from typing import Any

import numpy as np

from .._arrays import join
from .._batching import batch_length, split, sub_batch
from ..collectives.inline import reduced, same_layout
from ..collectives.shm_plans import INLINE_KINDS, InlinePlan
from ..collectives.ops import cast_to
from .._protocol.control import Command
from .._procs.shmem import SHRINK_BYTES
from .._protocol.data_refs import attach, forget
from .._kept.records import InlineBody
from .._kept.plans import PLANNED_KINDS, keep_plan, keep_worker_plan, publish_node_homes
from .homes import assign, receive_into, resident

__all__ = []


@dataclasses.dataclass
class CollectiveSpec:
    kind: str
    sids: list
    op: str | None = None
    rank: int | None = None
    refs: Any = None          # Data refs of values, when the master sends values
    batch: Any = None         # normalised batch per value (scatter, set_value)
    in_place: bool = True
    nd_up: int = 1
    cpu: bool = False         # a "c_" op: the CPU path, also on a GPU device


def send(s, spec: CollectiveSpec, plan_key=None):
    """Run ``spec`` in every process; the workers get it as a plain tuple (a
    dataclass takes several times longer to pickle, on every collective).
    Small values take the inline path (:func:`_send_inline`), which keeps a
    plan under ``plan_key`` (see :mod:`synkhronos._kept.plans`)."""
    if spec.kind in INLINE_KINDS:
        got = _send_inline(s, spec, plan_key)
        if got is not _NOT_INLINE:
            return got
    return s.run(Command.COLLECTIVE, wire_of(spec), lambda proc, _: run(proc, spec))


def wire_of(spec: CollectiveSpec) -> tuple:
    """What the workers get of ``spec`` (and what the steps among nodes name it by)."""
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec))


def worker_collective(proc, wire: tuple):
    if wire[0] is _INLINE:
        kept = proc.kept.worker_plans.get(id(wire))
        if kept is not None and kept.wire is wire and kept.run(proc):
            return None
        _run_inline(proc, *wire[1:])
        if wire[1] in PLANNED_KINDS and proc.control.message_kept:  # (else it never comes again)
            keep_worker_plan(proc, wire)
        return None
    spec = CollectiveSpec(*wire)
    got = run(proc, spec)
    if spec.kind == "all_reduce" and proc.comm.node_table() is not None and not proc.device.keeps_values_on_device:
        publish_node_homes(proc, spec.sids)  # across nodes: for the node master's direct path
    return got


# ---------------------------------------------------------------------------
# Small values inline: within one fork, on host memory, a collective whose
# values fit the communicator's inline areas is one command round trip, with no
# slot, pickled header or barrier. The master writes its values into its area
# before it posts the command (broadcast, all_reduce); a worker reads them from
# there, and writes its own into its area before it answers (reduce, gather,
# all_reduce), where the master reads them once every worker answered. For
# all_reduce every process combines every process's values itself, in rank
# order, with the Reducer of ops.combine, as the communicator's path: the same bits
# everywhere (with more than two processes the workers first wait for each
# other's values: the communicator's barrier, the master's half in the
# command). The command is the same from call to call: pickled once.

#: The first item of an inline command's wire tuple (a CollectiveSpec's is a kind).
_INLINE = None
#: What :func:`_send_inline` returns when the collective must take the communicator's path.
_NOT_INLINE = object()


def _inline_command(s, key, values, got):
    """The kept inline command ``key`` for ``values`` (``got``: the one kept for
    ``key``, if any): its pickled body, layout and plan; None when they cannot go inline."""
    for a in values:
        if type(a) is not np.ndarray:
            return None
    layout = tuple((a.dtype, a.shape) for a in values)
    if got is not None and got.layout == layout:
        return got
    proc = s.proc
    plan = proc.comm.plan(key[0], layout, key[2], reducers=proc.kept.reducers)
    if plan is None:
        return None
    body = pickle.dumps(([], (_INLINE,) + key), protocol=pickle.HIGHEST_PROTOCOL)
    return proc.kept.bodies.keep(key, InlineBody(body, layout, plan))


def _send_inline(s, spec: CollectiveSpec, plan_key=None):
    """``spec`` by the inline path, or ``_NOT_INLINE`` when it must take the communicator's;
    a collective that went through keeps its plan under ``plan_key`` (see :mod:`synkhronos._kept.plans`)."""
    proc = s.proc
    # workers still busy with an abandoned command might read the master's area: the full path settles them first
    if not proc.comm.within_fork or proc.device.keeps_values_on_device or not proc.control.all_answered():
        return _NOT_INLINE
    key = (spec.kind, tuple(spec.sids), spec.op)
    kept = proc.kept.bodies.get(key)
    vars_ = [proc.shareds[sid] for sid in spec.sids]
    values = [v.get_value(borrow=True) for v in vars_]
    if kept is None or not same_layout(values, kept.layout):  # (the usual case in a loop: the same)
        kept = _inline_command(s, key, values, kept)
        if kept is None:
            return _NOT_INLINE
    body, plan = kept.body, typing.cast(InlinePlan, kept.plan)
    kind, wire = spec.kind, (_INLINE,) + key
    if kind in ("broadcast", "all_reduce"):
        plan.post(values)
    if kind == "broadcast":
        s.run(Command.COLLECTIVE, wire, body=body)
        keep_plan(s, plan_key, kind, vars_, plan, None, wire, body)
        return None
    if kind == "all_reduce":
        # the master combines while the workers do: its half runs between post and collect
        if not s.run(Command.COLLECTIVE, wire, lambda p, _: plan.run(values, resident(p, key[1], vars_)), body=body):
            plan.mismatch()
        keep_plan(s, plan_key, kind, vars_, plan, spec.op, wire, body)
        return None
    s.run(Command.COLLECTIVE, wire, body=body)
    parts = plan.parts(values, same=kind == "reduce")
    if parts is None:
        if kind == "gather":  # a worker's values did not fit (unequal lengths): the communicator's path
            return _NOT_INLINE
        plan.mismatch()
    if kind == "gather":
        got = [join([p[i] for p in parts], spec.nd_up, v) for i, v in enumerate(vars_)]
        # (the workers' values may differ in shape from the master's: the plan maps each as it is)
        keep_plan(s, plan_key, kind, vars_, plan, spec.nd_up, wire, body,
                  peer_layouts=[tuple((a.dtype, a.shape) for a in p) for p in parts])
        return got
    got = _inline_reduce(proc, parts, spec, vars_)
    keep_plan(s, plan_key, kind, vars_, plan, spec.op, wire, body)
    return got


def _inline_reduce(proc, parts, spec: CollectiveSpec, vars_) -> list:
    """The master's reduce of the values in ``parts`` (per rank, in rank order)."""
    got = [reduced(proc, spec.op, [p[i] for p in parts], v.type.dtype) for i, v in enumerate(vars_)]
    if spec.in_place:
        for v, g in zip(vars_, got):
            assign(v, g)
    return got


def _run_inline(proc, kind, sids, op) -> None:
    """A worker's half of an inline collective."""
    vars_ = [proc.shareds[sid] for sid in sids]
    # (whatever this process holds: values that do not fit, or of another layout than the
    # master's, say so in its area, and the master raises, naming them)
    plan = typing.cast(InlinePlan, proc.comm.plan(kind, None, op, reducers=proc.kept.reducers))
    if kind == "broadcast":
        plan.receive(lambda i, src: receive_into(proc, sids[i], vars_[i], src))
        return
    # a gather's or reduce's values move into their homes (once), where the master can read them directly next time
    values = [v.get_value(borrow=True) for v in vars_] if kind == "all_reduce" else resident(proc, sids, vars_)
    plan.post(values)
    if kind == "all_reduce":  # values of another layout change nothing: the master raises, naming them
        plan.run(values, resident(proc, sids, vars_))


def run(proc, spec: CollectiveSpec):
    if spec.kind == "placement":
        return _placement(proc, spec)
    # the device's collective (GPU: NCCL, or the host path and back), else the host path
    return proc.device.shared_collective(proc, spec, _run_host)


def _placement(proc, spec: CollectiveSpec):
    """For the master, per variable, where every process keeps its value (True: on the device)."""
    got = proc.comm.gather([proc.device.placement(proc, spec.sids)], root=proc.master_rank)
    if got is None:
        return None
    return [np.array([per_rank[i] for per_rank in got[0]]) for i in range(len(spec.sids))]


def _run_host(proc, spec: CollectiveSpec):
    """The collective through the shared-memory communicator, on values in host memory."""
    vars_ = [proc.shareds[sid] for sid in spec.sids]
    comm, root = proc.comm, proc.master_rank
    mine = lambda: [v.get_value(borrow=True) for v in vars_]  # noqa: E731
    kind = spec.kind
    if kind == "broadcast":  # across nodes, other nodes' masters receive too
        comm.broadcast(resident(proc, spec.sids, vars_) if proc.is_master else None, root=root,
                       receive=lambda i, src: receive_into(proc, spec.sids[i], vars_[i], src))
    elif kind in ("scatter", "set_value"):
        _host_scatter(proc, spec, vars_)
    elif kind == "gather":
        # (across nodes, a node that has joined gives no parts: it is left out, as in a call)
        return comm.gather(resident(proc, spec.sids, vars_), root=root,
                           join=lambda i, parts: join([p for p in parts if p is not None], spec.nd_up, vars_[i]))
    elif kind == "all_gather":
        got = comm.all_gather(resident(proc, spec.sids, vars_))  # read in place, not via the slot
        # every variable joined before any is set: a refusal (the same in every process) changes none
        out = [_joined(v, parts) for v, parts in zip(vars_, got)]
        for v, joined in zip(vars_, out):
            assign(v, joined)
        # the caller's arrays are new memory, never the variables' own values
        return [np.array(a, copy=True) for a in out] if proc.is_master else None
    elif kind == "reduce":
        got = comm.reduce(resident(proc, spec.sids, vars_), spec.op, root=root)
        if got is not None and proc.is_master:
            got = [np.asarray(cast_to(np.asarray(g), v.type.dtype)) for g, v in zip(got, vars_)]
            if spec.in_place:
                for v, g in zip(vars_, got):
                    assign(v, g)
            return got
    elif kind == "all_reduce":
        arrays = resident(proc, spec.sids, vars_)
        got = comm.all_reduce(arrays, spec.op, in_place=True)
        for v, g in zip(vars_, got):
            if v.get_value(borrow=True) is not g:
                assign(v, g)
    elif kind == "get_value":
        got = comm.gather(mine() if comm.rank == spec.rank else None, root=root)
        if got is not None:
            return [parts[spec.rank] for parts in got]
    elif kind == "get_shapes":
        shapes = [np.array(v.get_value(borrow=True).shape, dtype=np.int64) for v in vars_]
        got = comm.gather(shapes, root=root)
        if got is not None:
            return [[tuple(int(d) for d in sh) for sh in per if sh is not None] for per in got]
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return None


def _joined(var, parts) -> np.ndarray:
    """An all_gather's value of ``var``: every process's part (None: absent) joined along axis 0."""
    present = [p for p in parts if p is not None]
    try:
        return np.concatenate(present, axis=0)
    except ValueError as err:
        raise ValueError(f"all_gather: shared variable {var.name or var!r} has shapes "
                         f"{[p.shape for p in present]} in the processes (in rank order), which do not "
                         f"join along axis 0 ({err}); no variable was changed") from None


def _host_scatter(proc, spec: CollectiveSpec, vars_) -> None:
    """scatter (each process its rows of the staged values) and set_value (one
    process takes them whole, or the rows of its ``batch``)."""
    comm = proc.comm  # ranks and sizes are global across nodes
    if spec.kind == "set_value" and comm.rank != spec.rank:
        return
    for v, ref, batch in zip(vars_, spec.refs, spec.batch):
        arr = attach(proc, ref)
        if spec.kind == "scatter":
            lo, hi = split(batch_length(batch, len(arr)), comm.size, comm.rank)
            arr = arr[sub_batch(batch, lo, hi)]
        elif batch is not None:
            arr = arr[batch]
        assign(v, np.array(arr, copy=True))
    # large staged values are used once: drop the mapping now (the master frees them)
    forget(proc, [ref[0] for ref in spec.refs
                  if math.prod(ref[3]) * np.dtype(ref[2]).itemsize >= SHRINK_BYTES])
