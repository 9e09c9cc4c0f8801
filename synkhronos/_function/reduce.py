"""The output reduction of a call: combining every process's outputs with their ops."""

from __future__ import annotations

import numpy as np

from .._arrays import concat
from ..collectives.ops import Reducer, combine, result_dtype
from ..errors import own_share_failed

__all__ = ["KeptReduction"]


class KeptReduction:
    """The output reduction of one planned call of a process alone in its fork, kept
    with the call's plan (a record of ``proc.kept.calls_of(fid)``, see
    :mod:`synkhronos._kept.records`): the communicator's kept reduce of the reduced
    outputs (:meth:`Communicator.plan`, kind ``"reduce"``: their layout, NCCL's
    counts, datatypes and ops, one group), and what :meth:`Device.guarded` keeps
    between calls (``guard``).

    **Validity.** ``plan`` was made from the outputs of a call that took the full
    reduction, and holds only for outputs of exactly that layout: the outputs'
    shapes follow the shared values' shapes, which ``set_value`` and updates may
    change at any call, so every use compares each output's dtype and shape with
    the kept ones, and one that differs drops ``plan`` before anything is sent: the
    full reduction runs and keeps a new one. Never kept: which outputs may be
    written in place (an output may be an input, a shared value, an update's value
    or another output, differently at every call): :meth:`Device.writable_outputs`
    answers it at every call.
    """

    __slots__ = ("plan", "idx", "guard", "weight", "groups")

    def __init__(self) -> None:
        self.plan = None   # the communicator's CommPlan of the reduced outputs, or None
        self.idx: list = []  # the positions of the outputs it reduces
        self.guard: dict = {}  # Device.guarded's own record (see there)
        self.weight = 1.0  # this process's weight in an avg, which ``groups``' plans were made with
        self.groups: dict = {}  # across nodes: per group of outputs (its index), MPI's CommPlan of it


def reduce_outputs(proc, outs, n_outputs, groups, weight, failed, guarded=None, kept=None):
    """Combine outputs across processes, one collective per group of outputs that
    share an op and a communicator (see :meth:`LocalFunction.plan`). On a device
    communicator the master's outputs are reduced in place where the device allows
    (:meth:`Device.writable_outputs`; ``guarded``: what it must never write into).
    ``kept``: a planned call's :class:`KeptReduction`, used and kept up to date: its
    reduction of every output at once (NCCL's), else, across nodes, its plan of each
    group of outputs (one exchange each, as the full path makes them)."""
    if kept is not None:
        if kept.plan is not None and not failed and outs is not None:
            results = _kept_reduce(proc, outs, n_outputs, groups, guarded, kept)
            if results is not None:
                return results
        if kept.weight != weight:  # (each group's plan carries the weight it was made with)
            kept.groups.clear()
            kept.weight = weight
        by_group = kept.groups if proc.size == 1 and outs is not None and proc.comm.among_nodes() is not None else None
        results = _reduce_groups(proc, outs, n_outputs, groups, weight, failed, guarded, by_group)
        _keep_reduction(proc, outs, groups, kept)
        return results
    return _reduce_groups(proc, outs, n_outputs, groups, weight, failed, guarded, None)


def _reduce_groups(proc, outs, n_outputs, groups, weight, failed, guarded, by_group):
    """:func:`reduce_outputs` without a kept reduction of every output at once; ``by_group``
    (or None) keeps, per group of outputs, the communicator's plan of it (across nodes)."""
    root = proc.master_rank
    results = [None] * n_outputs
    failure = None
    if proc.is_master and all(op is None for op, _, _ in groups):
        # nothing to reduce: across nodes the node masters still meet once, so that this call
        # is a step of its own there (a node's extra call, or its failure, is seen; join()
        # knows which node called last)
        inter = getattr(proc.comm, "inter", None)
        if inter is not None:
            inter.barrier(failed)
    for j, (op, comm, idx) in enumerate(groups):
        if op is None:
            if proc.is_master and outs is not None:
                for i in idx:
                    results[i] = outs[i]
            continue
        on_device = comm.device_arrays
        if outs is None:
            mine = None
        elif on_device:
            mine = [outs[i] for i in idx]
        else:  # the avg of integers is float64 from the start, sliced or not, small or large
            mine = [_as_result(outs[i], op) for i in idx]
        # Every process must take part in every collective, also after one failed:
        # a rooted collective tells only some processes that it failed, and the
        # others would wait in the next one for a hub that had left.
        flagged = failed or failure is not None
        try:
            if op == "gather":
                got = comm.gather(mine, root=root, failed=flagged, join=lambda _, parts: concat(parts))
                if got is not None:
                    for i, joined in zip(idx, got):
                        results[i] = joined
            else:
                if on_device and mine is not None and proc.is_master:
                    writable = proc.device.writable_outputs(proc, outs, idx, guarded)
                    got = comm.reduce(mine, op, root=root, weight=weight, failed=flagged, in_place=writable or False)
                elif by_group is None or on_device or mine is None or flagged:
                    got = comm.reduce(mine, op, root=root, weight=weight, failed=flagged)
                else:
                    got = _group_reduce(comm, op, mine, root, weight, by_group, j)
                if got is not None:
                    for i, r in zip(idx, got):
                        results[i] = r
        except Exception as err:
            if failure is None:
                failure = err
    if failure is not None:
        raise failure
    return results if proc.is_master else None


def _group_reduce(comm, op, mine, root, weight, by_group, j):
    """Group ``j``'s reduction through its kept plan (``by_group[j]``), or by the full path,
    which then keeps one: the same exchange, every node alike (see :class:`KeptReduction`)."""
    plan = by_group.get(j)
    if plan:
        got: list = [None] * len(mine)
        if plan.run(mine, got):  # (it raises as the full path would)
            return got
        del by_group[j]  # the outputs left it (nothing was sent): asked again below
        plan = None
    got = comm.reduce(mine, op, root=root, weight=weight)
    if plan is None:  # (False: none can be made for this group, asked once)
        by_group[j] = comm.plan("reduce", [(a.dtype, a.shape) for a in mine], (op,) * len(mine), weight=weight) \
            or False
    return got


def _kept_reduce(proc, outs, n_outputs, groups, guarded, kept):
    """:func:`reduce_outputs` through ``kept.plan``; None, ``kept.plan`` dropped and
    nothing sent, when the outputs left it."""
    idx = kept.idx
    values = [outs[i] for i in idx]
    writable = proc.device.writable_outputs(proc, outs, idx, guarded) or [False] * len(idx)
    targets = [v if w else None for v, w in zip(values, writable)]
    if not kept.plan.run(values, targets):
        kept.plan = None
        return None
    results = [None] * n_outputs
    for op, _, group in groups:
        if op is None:
            for i in group:
                results[i] = outs[i]
    for i, r in zip(idx, targets):
        results[i] = r
    return results


def _keep_reduction(proc, outs, groups, kept) -> None:
    """After a full reduction of ``outs`` in a process alone in its fork: ``kept.plan``
    for the next calls, when every reduced output goes through one device
    communicator that keeps such a reduce (else None: the full path each time)."""
    kept.plan, kept.idx = None, []
    if proc.size != 1 or outs is None:
        return
    comm, idx, ops = None, [], []
    for op, c, group in groups:
        if op is None:
            continue
        if op == "gather" or not c.device_arrays or (comm is not None and c is not comm):
            return
        comm = c
        idx += group
        ops += [op] * len(group)
    layout = [(getattr(outs[i], "dtype", None), getattr(outs[i], "shape", None)) for i in idx]
    if comm is not None:
        kept.plan = comm.plan("reduce", layout, tuple(ops))
        kept.idx = idx if kept.plan is not None else []


def reply_inline(proc, outs, ops, weight, error):
    """The outputs of an inline call: a worker sends them back with its answer
    (see :mod:`synkhronos._protocol.replies`); the master keeps ``(outs, its reducible
    outputs, weight)`` for :func:`combine_inline`."""
    if error is not None:  # (no protocol left to take part in)
        raise own_share_failed(error)
    mine = None if outs is None else [_as_result(outs[i], op) for i, op in enumerate(ops) if op is not None]
    if proc.is_master:
        return outs, mine, weight
    proc.control.put_outputs(proc.rank, mine, weight)
    return None


def combine_inline(proc, own, ops) -> tuple:
    """Master-side, after every worker answered an inline call: ``(results,
    spilled, weight)``, the outputs combined in rank order as the shared-memory
    communicator would combine them, whether a worker's outputs were too
    big for its reply area, and the contributing processes' weights together
    (across nodes, the node's weight in an ``avg``)."""
    outs, mine, weight = own
    ctl = proc.control
    ranks, sets, weights, spilled = [], [], [], False
    for r in range(proc.size):
        if r == proc.rank:
            got = None if mine is None else (mine, weight)
        else:
            got, big = ctl.outputs(r)
            spilled = spilled or big
        if got is not None:
            ranks.append(r)
            sets.append(got[0])
            weights.append(got[1])
    results = [None] * len(ops) if outs is None else list(outs)
    return combine_sets(ranks, sets, weights, [(k, op) for k, op in enumerate(ops) if op is not None],
                         results, node_parts=node_parts(proc)), spilled, sum(weights)


def node_parts(proc) -> int | None:
    """In the master of a node across nodes, its node's process count: an inline call's
    ``gather`` output is then kept as the list of its processes' parts (see
    :func:`combine_sets`), for :func:`finish_among_nodes`; None elsewhere."""
    return proc.size if proc.is_master and proc.comm.among_nodes() is not None else None


def finish_among_nodes(proc, results, weight, groups, n_rows) -> list:
    """In the master of a node of several processes, once an inline call's outputs were
    combined in the node (``results``, see :func:`combine_inline`; ``weight``: the node's
    contributing processes' weights together): each group of reduced outputs reduced
    among the nodes (:meth:`Communicator.reduce_node_part`), in the order, and with the
    exchanges, of the full path (:func:`reduce_outputs`), so that a node on either path
    meets the others byte for byte. As there, a failure is raised once every group took
    its part (the later ones flagged), and every node's result is in every node master."""
    if all(op is None for op, _, _ in groups):
        # nothing to reduce: the node masters still meet once, so that this call is a step there
        proc.comm.among_nodes().barrier()
        return results
    failure = None
    for op, comm, idx in groups:
        if op is None:
            continue
        part = None if results[idx[0]] is None else [results[i] for i in idx]
        try:
            if op == "gather":  # (each output: the list over the node's processes, see combine_sets)
                got = comm.gather_node_part([[None] * proc.size] * len(idx) if part is None else part,
                                            failed=failure is not None, join=lambda _, parts: concat(parts))
            else:
                got = comm.reduce_node_part(part, op, weight, failed=failure is not None)
        except Exception as err:  # noqa: BLE001 - raised once every group took its part
            failure = failure or err
            continue
        for i, r in zip(idx, got or [None] * len(idx)):
            results[i] = r
    if failure is not None:
        raise failure
    if n_rows == 0:
        no_rows_anywhere([results[i] for op, _, idx in groups if op is not None for i in idx])
    return results


def no_rows_anywhere(reduced) -> None:
    """A call of no rows on any node: ValueError when one of its ``reduced`` outputs has no value."""
    if any(r is None for r in reduced):
        raise ValueError("no node passed any rows to this call: its reduced outputs have no "
                         "values (each node adds its own rows; give at least one node some)")


def combine_sets(ranks, sets, weights, reduced, results, reducers=None, node_parts=None) -> list:
    """Fill ``results[k]`` for each reduced output ``(k, op)`` (the ``j``-th) from
    ``sets``, the reducible outputs of the contributing ``ranks`` in rank
    order, with their ``weights``: joined (``gather``), a copy of the one part,
    or :func:`combine` of them, which returns new memory for two parts or more.
    ``reducers``, a list with an entry per reduced output, keeps the
    :class:`~synkhronos.collectives.ops.Reducer` of each from call to call.
    ``node_parts``: across nodes, the node's process count; a ``gather`` output is
    then the list over the node's processes of their parts (None where absent), as
    the node's own gather gives them, for :func:`finish_among_nodes` to gather among
    the nodes (views of the replies: read within the call)."""
    for j, (k, op) in enumerate(reduced):
        parts = [arrays[j] for arrays in sets]
        if not parts:
            results[k] = None
        elif op == "gather" and node_parts is not None:
            per: list = [None] * node_parts
            for r, part in zip(ranks, parts):
                per[r] = part
            results[k] = per
        elif op == "gather":
            results[k] = concat(parts)
        elif len(parts) == 1:  # what combine() gives for one part, without its bookkeeping
            results[k] = np.array(parts[0], copy=True)
        else:
            first = parts[0]
            for r, p in zip(ranks[1:], parts[1:]):
                if p.shape != first.shape or p.dtype != first.dtype:
                    raise ValueError(f"cannot {op}-reduce: rank {ranks[0]} holds "
                                     f"[{(str(first.dtype), first.shape)}] but rank {r} holds "
                                     f"[{(str(p.dtype), p.shape)}] (output #{k})")
            if reducers is None:
                results[k] = combine(parts, op, weights)
                continue
            reducer = reducers[j]
            if reducer is None or not reducer.fits(first, weights, len(parts)):
                reducer = reducers[j] = Reducer(op, first.dtype, first.shape, weights, len(parts))
            results[k] = reducer(parts)
    return results


def _as_result(out, op) -> np.ndarray:
    """An output as an array of the dtype its reduction with ``op`` has."""
    arr = np.asarray(out)
    if op != "avg":  # only the avg of integers changes the dtype
        return arr
    return arr.astype(result_dtype(arr.dtype, op), copy=False)
