"""The worker's half of a call: this process's share of the rows, its run, and
the reply (the master runs the same for its own share)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np

from .._arrays import concat
from .._batching import check_batch, split, sub_batch
from .._kept.records import KeptCall
from .._state import interruptible
from ..collectives.ops import result_dtype
from .._protocol.data_refs import attach
from ..errors import PeerFailed, as_interrupt, own_share_failed
from .reduce import combine_sets, no_rows_anywhere, node_parts, reduce_outputs, reply_inline
from .spec import CallSpec

__all__ = []


@dataclasses.dataclass
class Share:
    """This process's part of a call: its rows, its weight, and (for a call
    that needs nothing worked out anew each time) its inputs and function."""

    lo: int
    hi: int
    weight: float
    active: bool              # computes at all (has rows, or is the master of an empty batch)
    rows: Any = None          # rows of the sliceable shared variables (batch_s), or None
    error: Any = None         # what went wrong while working this out
    args: list | None = None  # the inputs (None where the master passes its own), if kept
    fn: Any = None            # the compiled function, if kept
    trust: bool = False       # the kept inputs need no conversion: PyTensor may skip its checks


def share_of(proc, call: CallSpec, keep: bool = False, own_keys=()) -> Share:
    """This process's :class:`Share` of ``call``. With ``keep``, a call of one
    slice that selects no rows per call also gets its inputs (views that stay
    valid as long as the message does; ``own_keys`` left None) and function."""
    spec = proc.functions[call.fid].spec
    rows, error = None, None
    try:
        rows = _local_rows(proc, spec, call)
    except Exception as exc:
        error = exc
    if call.n_rows is None:
        lo = hi = 0
        if rows is not None:
            weight = float(len(rows))
        elif spec.sliceable and error is None:  # all rows of the sliceable variables
            weight = float(_sliceable_length(proc, spec))
        else:
            weight = 1.0
        # a batch_s that selects no row in any process: the master alone computes, as for an
        # empty batch of scattered inputs (else every output came back None)
        active = rows is None or len(rows) > 0 or (proc.is_master and proc.comm.within_fork
                                                   and _selects_none(call.batch_s))
    else:
        lo, hi = split(call.n_rows, proc.size, proc.rank)
        weight = float(hi - lo)
        # with no rows at all the master alone computes, as PyTensor would on an empty batch;
        # across nodes a node without rows adds nothing (the others' rows decide)
        active = hi > lo or (call.n_rows == 0 and proc.is_master and proc.comm.within_fork)
        if error is None and rows is not None and len(rows) != hi - lo:
            error = ValueError(f"rank {proc.rank}: batch_s selects {len(rows)} rows of the sliceable "
                               f"shared variables but this process has {hi - lo} rows of scattered inputs")
    share = Share(lo, hi, 0.0 if error is not None else weight, active, rows, error)
    # (a weight that is the length of the sliceable variables changes with them: such a share
    # is worked out again at every call, never kept with a stale weight)
    if keep and error is None and rows is None and call.num_slices == 1 \
            and (call.batch is None or isinstance(call.batch, slice)) \
            and not (spec.sliceable and call.n_rows is None):
        try:
            share.args = _local_inputs(proc, call, lo, hi, dict.fromkeys(own_keys))
            share.fn = proc.functions[call.fid].compiled(call.subset)
            share.trust = all(plain_input(var) for var in spec.inputs)
        except Exception:  # the call itself reports it
            share.args = share.fn = None
    return share


class Lane:
    """A kept :class:`Share` of an inline call, run with what every call of its
    kind shares worked out once: the inputs, the function, which outputs are
    reduced and which change dtype; in the master also the reply areas to
    read, in rank order. A worker finds its lane by the kept message (see
    :func:`worker_call`); the master's lane is part of the plan. Used only
    for an active share with nothing to check per call, and only while the
    replies are ordinary: anything else takes :func:`execute_call` and
    :func:`combine_inline`, which raise the errors."""

    __slots__ = ("fn", "args", "trust", "weight", "reduced", "casts", "areas", "ranks", "reducers", "kept", "total",
                 "node_parts")

    def __init__(self, proc, call: CallSpec, share: Share):
        spec = proc.functions[call.fid].spec
        ops = proc.functions[call.fid].plan(proc, call.subset)[0]
        chosen = range(len(spec.outputs)) if call.subset is None else call.subset
        # (Lane.of: a kept share, its fn set, has its inputs too)
        self.fn, self.args, self.trust, self.weight = share.fn, cast(list, share.args), share.trust, share.weight
        self.reduced = [(k, op) for k, op in enumerate(ops) if op is not None]
        # per reduced output: the dtype it is sent in, where its reduction changes it (avg of
        # ints); None when no output's does
        dtypes = [np.dtype(spec.outputs[i].type.dtype) for i in chosen]
        casts = [None if result_dtype(dtypes[k], op) == dtypes[k] else result_dtype(dtypes[k], op)
                 for k, op in self.reduced]
        self.casts = casts if any(d is not None for d in casts) else None
        self.areas = [None if r == proc.rank else proc.control.reply_area(r)
                      for r in range(proc.size)] if proc.is_master else None
        self.ranks = list(range(proc.size))
        # master, across nodes: a gather output is the list of the node's parts (see combine_sets)
        self.node_parts = node_parts(proc)
        self.reducers: list[Any] = [None] * len(self.reduced)  # master: each output's Reducer, kept
        self.kept = None  # master: what the last combine checked, see _keep
        self.total = 0.0  # master: the weights of the last combine together (what _keep checks stays)

    def run(self, proc, own=()):
        """``(outs, mine)``: this process's outputs, and its reducible ones in the
        dtype of their reduction (what :func:`reply_inline` sends). ``own``
        lists ``(position, value)`` of the inputs the master passes itself."""
        args = self.args
        if own:
            args = list(args)
            for i, value in own:
                args[i] = value
        proc.device.keep_on_device(proc)
        try:
            with interruptible:  # a worker: the master may stop this when it abandons the call
                outs = _run_kept(self.fn, args, self.trust)
        except Exception as exc:  # (an inline call: no protocol left to take part in)
            if as_interrupt(exc) is not exc:  # an interrupt, turned into SystemError by native code
                raise as_interrupt(exc) from None
            raise own_share_failed(exc)
        mine = [np.asarray(outs[k]) for k, _ in self.reduced]
        if self.casts is not None:
            for j, dtype in enumerate(self.casts):
                if dtype is not None:
                    mine[j] = mine[j].astype(dtype)
        return outs, mine

    def combine(self, outs, mine):
        """Master-side, once every worker answered: the results, the very values
        :func:`combine_inline` gives; None where a reply is out of the ordinary
        (no rows, too big for its area), for it to handle."""
        kept = self.kept
        if kept is not None:
            results = _combine_kept(kept, outs, mine)
            if results is not None:
                return results
        sets, weights = [], []
        for area in cast(list, self.areas):  # (master-side: the workers' reply areas)
            if area is None:
                sets.append(mine)
                weights.append(self.weight)
                continue
            got = area.inline()
            if got is None or len(got[0]) != len(mine):
                return None
            sets.append(got[0])
            weights.append(got[1])
        self.total = sum(weights)
        if not self.reduced:  # every reply ordinary, nothing to combine
            return list(outs)
        results = combine_sets(self.ranks, sets, weights, self.reduced, list(outs), self.reducers, self.node_parts)
        self.kept = self._keep(sets, weights, mine)
        return results

    def _keep(self, sets, weights, mine):
        """What a combine that went through every check leaves for the next one
        (see :func:`_combine_kept`): per worker its reply area, the list of its
        arrays (the area hands out the same list until the layout changes) and
        its weight; the parts in rank order with a hole at the master's place;
        the master's layout; per output the reduction to run. None with a
        single process (combine copies then)."""
        if len(sets) < 2:
            return None
        areas = cast(list, self.areas)  # (master-side: the workers' reply areas)
        workers = [(area, arrays, weight) for area, arrays, weight in zip(areas, sets, weights)
                   if area is not None]
        gather = concat if self.node_parts is None else list  # (every process answered: every part is there)
        steps = [(k, j, gather if op == "gather" else self.reducers[j].run)
                 for j, (k, op) in enumerate(self.reduced)]
        return (workers, [None if arrays is mine else arrays for arrays in sets], areas.index(None),
                [(a.shape, a.dtype) for a in mine], steps)

    @staticmethod
    def of(proc, call: CallSpec, share: Share):
        """The lane of ``share``, or None where the call needs :func:`execute_call`."""
        if not call.inline or share.fn is None or not share.active:
            return None
        return Lane(proc, call, share)


def _combine_kept(kept, outs, mine):
    """:meth:`Lane.combine` when every reply is what the last combine checked:
    each worker's area hands out the same list of arrays with the same weight,
    and the master's outputs have the same shapes and dtypes (so every check of
    :func:`combine_sets` holds again). None when anything differs."""
    workers, sets, slot, layout, steps = kept
    for area, arrays, weight in workers:
        got = area.inline()
        if got is None or got[0] is not arrays or got[1] != weight:
            return None
    for a, (shape, dtype) in zip(mine, layout):
        if a.shape != shape or a.dtype != dtype:
            return None
    results = list(outs)
    sets[slot] = mine
    try:
        for k, j, run in steps:
            results[k] = run([arrays[j] for arrays in sets])
    finally:
        sets[slot] = None  # the master's outputs are not kept past the call
    return results


def plain_input(var) -> bool:
    """Whether PyTensor checks a value for input ``var`` by dtype and ndim alone
    (no static shape): a value that has both, aligned, needs no conversion.
    Shared memory views and the master's planned inputs are checked for that."""
    shape = getattr(var.type, "shape", None)
    return shape is not None and all(d is None for d in shape)


def _run_kept(fn, args, trust: bool):
    """``fn(*args)``; with ``trust``, without PyTensor's input checks (the
    inputs are known to be right: kept shared-memory views, or planned
    inputs whose dtype, ndim and alignment were checked)."""
    if not trust:
        return fn(*args)
    try:
        fn.trust_input = True  # inside try: an interrupt before it still resets it
        return fn(*args)
    finally:
        fn.trust_input = False


def execute_call(proc, call: CallSpec, own=None, share: Share | None = None, kept=None):
    """Compute this process's share of a call and take part in the output reductions.

    ``own`` maps input positions to arrays the master passes directly;
    ``share`` is this process's :func:`share_of` the call, when kept; ``kept``
    the planned call's :class:`~.reduce.KeptReduction` (a master alone in its fork).
    Returns the reduced outputs in the master, None in workers (for an
    inline call, the master's own part, see :func:`combine_inline`).
    """
    lf = proc.functions[call.fid]
    ops, groups = lf.plan(proc, call.subset)
    if share is None:
        share = share_of(proc, call)
    outs, error, weight = None, share.error, share.weight
    guarded = None  # the master: memory its outputs' reduction must not write into
    if share.active and error is None:
        try:
            if share.fn is not None:
                args = cast(list, share.args)  # (share_of keeps the inputs with the function)
                if own:
                    args = list(args)
                    for i, value in own.items():
                        args[i] = value
            else:
                args = _local_inputs(proc, call, share.lo, share.hi, own)
            proc.device.keep_on_device(proc)
            if proc.is_master and not call.inline:
                guarded = proc.device.guarded(proc, args, None if kept is None else kept.guard)
            with interruptible:  # a worker: the master may stop this when it abandons the call
                if share.fn is not None:
                    outs = _run_kept(share.fn, args, share.trust)
                else:
                    outs = lf.run(args, call.subset, call.num_slices,
                                  None if call.n_rows is None else share.hi - share.lo, ops, share.rows)
            proc.device.keep_on_device(proc)  # updates accumulated over slices come back to the host
        except Exception as exc:
            if as_interrupt(exc) is not exc:  # an interrupt, turned into SystemError by native code
                raise as_interrupt(exc) from None
            error = exc
    own_only = None  # a master without rows: its own results (op None) on its empty share
    if not share.active and error is None and proc.is_master and None in ops \
            and (call.n_rows is not None or share.rows is not None):
        try:
            own_only = _own_results(proc, lf, call, ops, share, own)
        except Exception as exc:  # noqa: BLE001 - its own share failed, as any share may
            error = exc
    if call.inline:
        got = reply_inline(proc, outs, ops, weight, error)
        return got if own_only is None else (own_only, got[1], got[2])
    try:
        results = reduce_outputs(proc, outs, len(ops), groups, weight, error is not None, guarded, kept)
        if own_only is not None:
            results = [own_only[k] if op is None else r for k, (op, r) in enumerate(zip(ops, results))]
        if proc.is_master and call.n_rows == 0 and not proc.comm.within_fork:
            no_rows_anywhere([results[k] for k, op in enumerate(ops) if op is not None])
    except PeerFailed:
        # the collective fails in every process, the failing one too: report its own error
        if error is not None:
            raise own_share_failed(error) from None
        raise
    if error is not None:
        raise own_share_failed(error)
    return results


def _own_results(proc, lf, call, ops, share, own) -> list:
    """The master's own results (the outputs of op None) when it has no rows: those
    outputs alone, on its empty share, its updates not applied (it takes no part)."""
    chosen = range(len(lf.spec.outputs)) if call.subset is None else call.subset
    mine = [j for j, op in enumerate(ops) if op is None]
    sliced = share.rows is not None  # (batch_s: on its selection of the sliceable variables, none)
    fn = lf.compiled(tuple(chosen[j] for j in mine), values=True, sliced=sliced)
    args = _local_inputs(proc, call, share.lo, share.hi, own)
    got = fn(*args, share.rows) if sliced else fn(*args)
    results = [None] * len(ops)
    for i, j in enumerate(mine):
        results[j] = got[i]
    return results


def _selects_none(batch_s) -> bool:
    """Whether ``batch_s`` (one entry per rank, as the master checked it) selects no row
    in any process, whatever their lengths: every entry an empty index array, or a slice
    that leaves no row within any bounds (a process whose rows it exceeds refuses it)."""
    if not batch_s:
        return False
    return all((isinstance(b, slice) and not len(range(*b.indices(1 << 62))))
               or (isinstance(b, np.ndarray) and b.size == 0) for b in batch_s)


def _sliceable_length(proc, spec) -> int:
    lengths = {len(v.get_value(borrow=True)) for v in spec.sliceable}
    if len(lengths) > 1:
        raise ValueError(f"rank {proc.rank}: sliceable shared variables differ in length: "
                         f"{[(v.name, len(v.get_value(borrow=True))) for v in spec.sliceable]}")
    return lengths.pop()


def _local_rows(proc, spec, call):
    """This process's rows of its sliceable shared variables, or None for all of them.

    Without ``batch_s`` the whole variables are used as they are, except when
    ``num_slices`` must split their rows (and no scattered input sets the rows).
    """
    if not spec.sliceable:
        return None
    if call.batch_s is None:
        if call.num_slices == 1 or call.n_rows is not None:
            return None
        mine = None
    else:
        mine = call.batch_s[proc.rank]
    length = _sliceable_length(proc, spec)
    try:
        sel = check_batch(mine, length)
    except IndexError as err:
        raise IndexError(f"rank {proc.rank}: batch_s is beyond this process's rows of "
                         f"the sliceable shared variables: {err}") from None
    if sel is None:
        return np.arange(length, dtype=np.int64)
    if isinstance(sel, slice):
        return np.arange(sel.start, sel.stop, sel.step, dtype=np.int64)
    return sel


def _local_inputs(proc, call, lo, hi, own):
    batch = call.batch
    if batch is not None and not isinstance(batch, slice):
        batch = attach(proc, batch)
    args = []
    for i, (kind, ref) in enumerate(call.inputs):
        if own is not None and i in own:
            args.append(own[i])
            continue
        arr = attach(proc, ref)
        if kind == "b":
            args.append(arr)
        elif kind == "m":
            args.append(arr[lo:hi])
        else:
            args.append(arr[sub_batch(batch, lo, hi)])
    return args


def worker_call(proc, wire: tuple) -> None:
    """A worker's CALL: a kept message again (the master sent the same bytes,
    see ControlBlock.post) runs on the share kept for it."""
    kept = proc.kept.calls.get(id(wire))
    if kept is not None and kept.wire is wire:
        call, share, lane = kept.call, kept.share, kept.lane
    else:
        call = CallSpec(*wire)
        share = share_of(proc, call, keep=True)
        lane = Lane.of(proc, call, share)
        if share.fn is not None and proc.control.message_kept:  # (else it never comes again)
            proc.kept.calls.keep(id(wire), KeptCall(wire, call, share, lane))
    if lane is None:
        execute_call(proc, call, share=share)
        return
    proc.control.put_outputs(proc.rank, lane.run(proc)[1], lane.weight)
