"""synk.function: data-parallel PyTensor functions, master and worker halves."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import warnings
from typing import Any

import numpy as np
import pytensor
from pytensor.graph.basic import Variable
from pytensor.scalar import upcast

from .. import _state as context
from .._protocol import across_nodes as nodes
from .._arrays import concat
from .._batching import batch_length, check_batch, split, sub_batch
from ..collectives.ops import OUTPUT_OPS, Reducer, cast_to, check_op, combine, result_dtype
from .._state import interruptible
from .._protocol.control import Command
from ..data import Data, attach, fit_scratch
from ..data import data as make_data
from ..data import check_alive as check_data_alive, label as data_label, ref as data_ref
from ..devices.gpu_stack import jax_linker
from .._protocol.distribute import distribute, graph_digest
from .._kept.records import KeptCall
from ..errors import PeerFailed, SynkError, as_interrupt, own_share_failed, short_repr, user_stacklevel
from ..jax_dtypes import typed_jax_mode
from .._procs.shmem import oversized

__all__ = ["Function", "function"]


@dataclasses.dataclass
class FunctionSpec:
    """Everything a process needs to build its copy of a function (pickled to workers)."""

    fid: int
    name: str
    inputs: list
    outputs: list
    output_ops: list          # op name or None, per output
    updates: list             # [(shared variable, expression)]
    update_ops: list          # op name per update, used across num_slices
    givens: Any
    kwargs: dict
    bcast: tuple              # per input: broadcast (True) or scattered (False)
    sliceable: list           # shared variables sliced by batch_s
    returns_list: bool
    output_modes: list = dataclasses.field(default_factory=list)  # ops as given ("c_sum" stays)
    nccl: bool = True         # on a GPU device, reduce outputs through NCCL (except "c_" ops)


@dataclasses.dataclass
class CallSpec:
    """One call, as sent to the workers: references only, never the data itself."""

    fid: int
    inputs: list              # per input: (kind, Data ref); kind "b", "s" (batch) or "m" (positions)
    batch: Any                # None, a slice, or a Data ref of int64 indices
    n_rows: int | None        # rows to split, None when no input is scattered
    num_slices: int
    subset: tuple | None
    batch_s: Any = None       # None, or per rank: None, a slice, or an int64 index array
    inline: bool = False      # outputs ride back with the answers (replies), no collective

    def to_wire(self) -> tuple:
        """A plain tuple: pickles in a fraction of a dataclass's time (every call pays it)."""
        return (self.fid, self.inputs, self.batch, self.n_rows, self.num_slices, self.subset,
                self.batch_s, self.inline)


class LocalFunction:
    """One process's compiled copies of a function, and how it runs its share."""

    def __init__(self, spec: FunctionSpec):
        self.spec = spec
        self._compiled = {}
        self._plans = {}

    def compiled(self, subset=None, values=False, sliced=False):
        """The PyTensor function for an output subset.

        ``values`` returns the update values instead of applying them;
        ``sliced`` takes one more input, the rows of the sliceable shared
        variables to use.
        """
        key = (subset, values, sliced)
        fn = self._compiled.get(key)
        if fn is None:
            spec = self.spec
            outs = spec.outputs if subset is None else [spec.outputs[i] for i in subset]
            inputs, givens = list(spec.inputs), spec.givens
            if sliced:
                rows = pytensor.tensor.lvector("batch_s")
                inputs.append(rows)
                pairs = list(givens.items()) if isinstance(givens, dict) else list(givens or [])
                givens = pairs + [(var, var[rows]) for var in spec.sliceable]
            kwargs = spec.kwargs
            if subset is not None:  # as in PyTensor, a subset need not use every input
                kwargs = {**kwargs, "on_unused_input": "ignore"}
            jax_mode = _jax_mode(kwargs.get("mode"))
            if context.jax_inherited and jax_mode:
                raise RuntimeError(
                    f"function {spec.name or '?'} compiles in JAX mode, but JAX was already running in the "
                    "master when synk.fork() started this worker, and JAX cannot run in a process forked "
                    "after it started (it aborts or hangs): call synk.fork() before any JAX computation")
            if jax_mode:  # PyTensor's JAX rendering alone returns some float32 results as float64
                kwargs = {**kwargs, "mode": typed_jax_mode(kwargs.get("mode"))}
            if values:
                fn = pytensor.function(inputs, list(outs) + [u for _, u in spec.updates],
                                       givens=givens, **kwargs)
            else:
                fn = pytensor.function(inputs, list(outs), updates=spec.updates,
                                       givens=givens, **kwargs)
            self._compiled[key] = fn
        return fn

    def plan(self, proc, subset):
        """``(ops, groups)`` for an output subset: each output's op, and the outputs
        grouped by (op, communicator), one collective per group. Cached: the
        same for every call."""
        plan = self._plans.get(subset)
        if plan is None:
            spec = self.spec
            chosen = subset if subset is not None else tuple(range(len(spec.outputs)))
            ops = [spec.output_ops[i] for i in chosen]
            modes = spec.output_modes or spec.output_ops
            # the device's communicator (NCCL), except for c_ ops and functions built with nccl=False
            comms = [proc.device.comm_for(proc, cpu=not spec.nccl or (isinstance(modes[i], str)
                                                                     and modes[i].startswith("c_")))
                     for i in chosen]
            grouped: dict = {}
            for i, op in enumerate(ops):
                grouped.setdefault((op, comms[i]), []).append(i)
            plan = self._plans[subset] = (ops, [(op, comm, idx) for (op, comm), idx in grouped.items()])
        return plan

    def run(self, args, subset, num_slices: int, n_rows: int | None, ops, rows=None):
        """Run on this process's inputs; with ``num_slices`` > 1 accumulate over slices.

        ``rows`` selects rows of the sliceable shared variables (batch_s).
        """
        sliced = rows is not None
        if sliced:
            args = list(args) + [rows]
            if n_rows is None:
                n_rows = len(rows)
        if num_slices == 1 or n_rows is None or n_rows <= 1:
            return self.compiled(subset, sliced=sliced)(*args)
        spec = self.spec
        split_arg = list(b for b in spec.bcast) + ([False] if sliced else [])
        fn = self.compiled(subset, values=True, sliced=sliced)
        n_out = len(ops)
        outs_parts, upd_parts, weights = [[] for _ in range(n_out)], [[] for _ in spec.updates], []
        for k in range(num_slices):
            lo, hi = split(n_rows, num_slices, k)
            if hi == lo:
                continue
            res = fn(*[a if b else a[lo:hi] for a, b in zip(args, split_arg)])
            for i in range(n_out):
                outs_parts[i].append(res[i])
            for j in range(len(spec.updates)):
                upd_parts[j].append(res[n_out + j])
            weights.append(hi - lo)
        chosen = range(n_out) if subset is None else subset
        outs = [_accumulate(parts, op, weights, spec.outputs[k])
                for parts, op, k in zip(outs_parts, ops, chosen)]
        for (var, _), op, parts in zip(spec.updates, spec.update_ops, upd_parts):
            value = _accumulate(parts, op, weights, var)
            var.set_value(cast_to(np.asarray(value), var.type.dtype), borrow=True)
        return outs


def _accumulate(parts, op, weights, var):
    """One process's value of an output (or update) from its slices' values.

    Reductions combine the slices as they combine processes. ``gather`` and
    ``None`` keep every row: the slices' rows joined in order, which is the
    unsliced result only for an output with one row per input row; anything
    else is refused, never returned different from the unsliced call.
    """
    if op is not None and op != "gather":
        return combine(parts, op, weights)
    for part, rows in zip(parts, weights):
        shape = np.shape(part)
        if not shape or shape[0] != rows:
            raise ValueError(
                f"output {var.name or var} (op {op!r}) has shape {shape} for a slice of {rows} rows: "
                "it is not one row per input row, so its slices cannot be joined into the result "
                "of the whole call; use num_slices=1 for it, or a reducing op")
    return concat(parts)


# ---------------------------------------------------------------------------
# Executed by every process, master included.


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
        active = rows is None or len(rows) > 0
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
            share.trust = all(_plain_input(var) for var in spec.inputs)
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

    __slots__ = ("fn", "args", "trust", "weight", "reduced", "casts", "areas", "ranks", "reducers", "kept")

    def __init__(self, proc, call: CallSpec, share: Share):
        spec = proc.functions[call.fid].spec
        ops = proc.functions[call.fid].plan(proc, call.subset)[0]
        chosen = range(len(spec.outputs)) if call.subset is None else call.subset
        self.fn, self.args, self.trust, self.weight = share.fn, share.args, share.trust, share.weight
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
        self.reducers = [None] * len(self.reduced)  # master: each output's Reducer, kept
        self.kept = None  # master: what the last combine checked, see _keep

    def run(self, proc, own=()):
        """``(outs, mine)``: this process's outputs, and its reducible ones in the
        dtype of their reduction (what :func:`_reply_inline` sends). ``own``
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
        for area in self.areas:
            if area is None:
                sets.append(mine)
                weights.append(self.weight)
                continue
            got = area.inline()
            if got is None or len(got[0]) != len(mine):
                return None
            sets.append(got[0])
            weights.append(got[1])
        if not self.reduced:  # every reply ordinary, nothing to combine
            return list(outs)
        results = _combine_sets(self.ranks, sets, weights, self.reduced, list(outs), self.reducers)
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
        workers = [(area, arrays, weight) for area, arrays, weight in zip(self.areas, sets, weights)
                   if area is not None]
        steps = [(k, j, concat if op == "gather" else self.reducers[j].run)
                 for j, (k, op) in enumerate(self.reduced)]
        return (workers, [None if arrays is mine else arrays for arrays in sets], self.areas.index(None),
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
    :func:`_combine_sets` holds again). None when anything differs."""
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


def _plain_input(var) -> bool:
    """Whether PyTensor checks a value for input ``var`` by dtype and ndim alone
    (no static shape): a value that has both, aligned, needs no conversion.
    Shared memory views and the master's planned inputs are checked for that."""
    shape = getattr(var.type, "shape", None)
    return shape is not None and all(d is None for d in shape)


def _jax_mode(mode) -> bool:
    """Whether PyTensor ``mode`` (a name, a Mode, or None for the default) runs through JAX."""
    try:
        linker = pytensor.compile.mode.get_mode(mode).linker
    except Exception:  # a mode PyTensor does not know: pytensor.function will say so
        return False
    return jax_linker(linker)


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


def execute_call(proc, call: CallSpec, own=None, share: Share | None = None):
    """Compute this process's share of a call and take part in the output reductions.

    ``own`` maps input positions to arrays the master passes directly;
    ``share`` is this process's :func:`share_of` the call, when kept.
    Returns the reduced outputs in the master, None in workers (for an
    inline call, the master's own part, see :func:`combine_inline`).
    """
    lf = proc.functions[call.fid]
    ops, groups = lf.plan(proc, call.subset)
    if share is None:
        share = share_of(proc, call)
    outs, error, weight = None, share.error, share.weight
    if share.active and error is None:
        try:
            if share.fn is not None:
                args = share.args
                if own:
                    args = list(args)
                    for i, value in own.items():
                        args[i] = value
            else:
                args = _local_inputs(proc, call, share.lo, share.hi, own)
            proc.device.keep_on_device(proc)
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
    if not share.active and error is None and proc.is_master and call.n_rows is not None and None in ops:
        try:
            own_only = _own_results(proc, lf, call, ops, share, own)
        except Exception as exc:  # noqa: BLE001 - its own share failed, as any share may
            error = exc
    if call.inline:
        got = _reply_inline(proc, outs, ops, weight, error)
        return got if own_only is None else (own_only, got[1], got[2])
    try:
        results = _reduce_outputs(proc, outs, len(ops), groups, weight, error is not None)
        if own_only is not None:
            results = [own_only[k] if op is None else r for k, (op, r) in enumerate(zip(ops, results))]
        if proc.is_master and call.n_rows == 0 and not proc.comm.within_fork and any(
                results[k] is None for k, op in enumerate(ops) if op is not None):
            raise ValueError("no node passed any rows to this call: its reduced outputs have no "
                             "values (each node adds its own rows; give at least one node some)")
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
    fn = lf.compiled(tuple(chosen[j] for j in mine), values=True)
    got = fn(*_local_inputs(proc, call, share.lo, share.hi, own))
    results = [None] * len(ops)
    for i, j in enumerate(mine):
        results[j] = got[i]
    return results


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


def _reduce_outputs(proc, outs, n_outputs, groups, weight, failed):
    """Combine outputs across processes, one collective per group of outputs that
    share an op and a communicator (see :meth:`LocalFunction.plan`)."""
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
    for op, comm, idx in groups:
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
                got = comm.reduce(mine, op, root=root, weight=weight, failed=flagged)
                if got is not None:
                    for i, r in zip(idx, got):
                        results[i] = r
        except Exception as err:
            if failure is None:
                failure = err
    if failure is not None:
        raise failure
    return results if proc.is_master else None


def _reply_inline(proc, outs, ops, weight, error):
    """The outputs of an inline call: a worker sends them back with its answer
    (see :mod:`synkhronos.replies`); the master keeps ``(outs, its reducible
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
    spilled)``, the outputs combined in rank order as the shared-memory
    communicator would combine them, and whether a worker's outputs were too
    big for its reply area."""
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
    return _combine_sets(ranks, sets, weights, [(k, op) for k, op in enumerate(ops) if op is not None],
                         results), spilled


def _combine_sets(ranks, sets, weights, reduced, results, reducers=None) -> list:
    """Fill ``results[k]`` for each reduced output ``(k, op)`` (the ``j``-th) from
    ``sets``, the reducible outputs of the contributing ``ranks`` in rank
    order, with their ``weights``: joined (``gather``), a copy of the one part,
    or :func:`combine` of them, which returns new memory for two parts or more.
    ``reducers``, a list with an entry per reduced output, keeps the
    :class:`~synkhronos.collectives.ops.Reducer` of each from call to call."""
    for j, (k, op) in enumerate(reduced):
        parts = [arrays[j] for arrays in sets]
        if not parts:
            results[k] = None
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


# ---------------------------------------------------------------------------
# Master side.


class Function:
    """A PyTensor function run data-parallel by every process of the fork.

    Build it with :func:`synkhronos.function`.

    Attributes:
        name: the function's name (for messages).
        output_modes: the reduce op of each output.
        update_modes: the op accumulating each update over ``num_slices``.
    """

    def __init__(self, spec: FunctionSpec, local: LocalFunction):
        self._spec = spec
        self._local = local
        self._scratch: dict = {}
        self._owner = None  # the Session (fork) it was built for
        self._cast_warned: set = set()  # (input position, dtype) of synk.data cast already
        self._spilled: set = set()  # output subsets whose outputs were too big to ride inline
        self._planned = None  # planned calls: _plan_key -> _Plan (the fork's kept.calls_of(fid), once built)
        self._input_names = [getattr(v, "name", None) for v in spec.inputs]
        # per input: (dtype, ndim, plain), plain when PyTensor checks its type by
        # dtype and ndim alone: an ndarray that already has both needs no
        # conversion (the common case, made fast)
        self._types = [(np.dtype(v.type.dtype), v.type.ndim, _plain_input(v)) for v in spec.inputs]

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def output_modes(self) -> list:
        """The reduce op of each output, as given (a ``c_`` prefix, which forces
        the CPU path on a GPU device, is kept)."""
        return list(self._spec.output_modes)

    @property
    def update_modes(self) -> list:
        return list(self._spec.update_ops)

    @property
    def inputs(self) -> list:
        return list(self._spec.inputs)

    def __repr__(self) -> str:
        return f"<synk.Function {self.name!r}: {len(self._spec.inputs)} inputs, {len(self._spec.outputs)} outputs>"

    # -- plain PyTensor ----------------------------------------------------

    def as_pytensor(self, *args, **kwargs):
        """Run the plain PyTensor function in the master only, on all of the inputs.

        Updates apply to the master's shared variables. Returns what
        PyTensor returns for the function's outputs.
        """
        values = self._bind(args, kwargs)
        values = [v.data if isinstance(v, Data) else v for v in values]
        out = self._local.compiled()(*values)
        return self._shape_result(out)

    as_theano = as_pytensor

    def as_op(self, given=None, grads=None):
        """This function as a PyTensor Op, for any PyTensor graph (PyMC, scipy.optimize, ...).

        Each evaluation of the Op is one distributed call of this function.

        Args:
            given: ``{input: value}`` for the inputs that keep one value (an
                input named by its variable, name or position). A numpy value of
                a scattered input is copied into a :func:`synkhronos.data` once;
                a synk.data passes as it is (it must have the input's dtype).
            grads: ``{value output: [gradient output, ...]}``: for a scalar
                output reduced with ``"sum"`` or ``"avg"``, the outputs that hold
                its gradient with respect to each free input (``None`` for an
                input it does not depend on). The Op's gradient then comes from
                the same call as its value.

        Returns:
            A :class:`synkhronos.graph_op.SynkOp`: its inputs are the inputs not
            in ``given``, in order; its outputs all the function's outputs.

        Raises:
            TypeError, ValueError, IndexError: a bad input, value or gradient
                declaration, named in the message.
        """
        from ..graph_op import build_op, position

        spec = self._spec
        if given is not None and not isinstance(given, dict):
            raise TypeError(f"given must be a dict {{input: value}}, got {given!r}")
        fixed = {}
        for key, value in (given or {}).items():
            i = position(key, spec.inputs, "input", self.name)
            if i in fixed:
                raise ValueError(f"input {spec.inputs[i].name or i!r} of function {self.name!r} given twice")
            if isinstance(value, Data) and value.dtype != np.dtype(spec.inputs[i].type.dtype):
                raise TypeError(f"given: synk.data {data_label(value)} has dtype {value.dtype}; input "
                                f"{spec.inputs[i].name or i!r} expects {spec.inputs[i].type.dtype}")
            value = self._check_value(i, value)
            if not spec.bcast[i] and not isinstance(value, Data):  # rows in shared memory once
                value = make_data(value, var=spec.inputs[i], name=spec.inputs[i].name)
            fixed[i] = value
        return build_op(self, spec.inputs, spec.outputs, spec.bcast, fixed, grads)

    # -- inputs ------------------------------------------------------------

    def build_inputs(self, *args, force_cast=False, oversize=1.0, minibatch=False, **kwargs):
        """Copy input values into new :class:`synkhronos.Data` objects, one per input.

        Passing these to the function later sends no input data at call time.

        Args:
            *args: one value per input, in order, as for a call.
            force_cast: passed to :func:`synkhronos.data`.
            oversize: passed to :func:`synkhronos.data`.
            minibatch: passed to :func:`synkhronos.data`: one flag for every
                input, or a list with one flag per input.
            **kwargs: input values by input name.

        Returns:
            A list of Data (a single Data for a one-input function).

        Raises:
            TypeError: missing, extra or unknown inputs; a value
                :func:`synkhronos.data` refuses.
            ValueError: a ``minibatch`` list of the wrong length.
        """
        n = len(self._spec.inputs)
        if not kwargs and len(args) != n:
            raise TypeError(f"function {self.name!r} takes {n} inputs, build_inputs got {len(args)}")
        values = self._bind(args, kwargs)
        flags = list(minibatch) if isinstance(minibatch, (list, tuple)) else [minibatch] * n
        if len(flags) != n:
            raise ValueError(f"minibatch has {len(flags)} entries for the {n} inputs of function "
                             f"{self.name!r}")
        out = []
        for var, value, flag in zip(self._spec.inputs, values, flags):
            out.append(make_data(value, var=var, force_cast=force_cast, oversize=oversize,
                                 minibatch=flag, name=var.name))
        return out[0] if len(out) == 1 else out

    def _bind(self, args, kwargs):
        inputs = self._spec.inputs
        if len(args) > len(inputs):
            raise TypeError(f"function {self.name!r} takes {len(inputs)} inputs, got {len(args)} "
                            "positional arguments")
        values = list(args) + [_MISSING] * (len(inputs) - len(args))
        for key, value in kwargs.items():
            try:
                i = self._input_names.index(key)
            except ValueError:
                raise TypeError(f"function {self.name!r} has no input named {key!r}; its inputs are "
                                f"{self._input_names}") from None
            if values[i] is not _MISSING:
                raise TypeError(f"input {key!r} of function {self.name!r} given twice")
            values[i] = value
        missing = [self._input_names[i] or f"#{i}" for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise TypeError(f"function {self.name!r} is missing inputs {missing}")
        return values

    def _check_value(self, i, value):
        dtype, ndim, plain = self._types[i]
        if plain and type(value) is np.ndarray and value.dtype == dtype and value.ndim == ndim:
            return value
        var = self._spec.inputs[i]
        label = f"input {var.name or i!r} of function {self.name!r}"
        # wrong ndim or dtype is a TypeError, as in PyTensor's own functions
        if isinstance(value, Data):
            check_data_alive(value)
            if value.ndim != var.type.ndim:
                raise TypeError(f"{label} expects ndim={var.type.ndim}, got synk.data with ndim={value.ndim}")
            if value.dtype != np.dtype(var.type.dtype):
                return self._cast_data(i, value, np.dtype(var.type.dtype), label)
            return value
        arr = np.asarray(value) if not isinstance(value, np.ndarray) else value
        if arr.dtype.kind in "OUSV":  # objects, strings, raw bytes
            raise TypeError(f"{label} expects a numeric array of dtype {var.type.dtype}, got an array of "
                            f"dtype {arr.dtype}: {short_repr(value)}")
        if arr.ndim != var.type.ndim:
            raise TypeError(f"{label} expects ndim={var.type.ndim}, got ndim={arr.ndim} (shape {arr.shape})")
        try:
            return var.type.filter(value, strict=False,
                                   allow_downcast=self._spec.kwargs.get("allow_input_downcast"))
        except TypeError as err:
            raise TypeError(f"{label}: {err}") from None

    def _cast_data(self, i, value: Data, want: np.dtype, label: str) -> Data:
        """A synk.data of another dtype, cast where PyTensor would cast a numpy array of
        its dtype: one copy per call, into shared memory, and a warning the first time."""
        downcast = self._spec.kwargs.get("allow_input_downcast")
        if not (downcast or upcast(want.name, value.dtype.name) == want.name):
            raise TypeError(f"{label} expects dtype {want}, got synk.data {data_label(value)} of dtype "
                            f"{value.dtype}, which would lose precision: create it with "
                            f"synk.data(value, dtype={want.name!r}) (or var=the input), or pass "
                            "allow_input_downcast=True to synk.function")
        if (i, value.dtype) not in self._cast_warned:
            self._cast_warned.add((i, value.dtype))
            warnings.warn(f"{label} expects dtype {want}, got synk.data {data_label(value)} of dtype "
                          f"{value.dtype}: every call casts a copy of it ({value.size * want.itemsize} "
                          f"bytes now) into shared memory; create it with synk.data(value, "
                          f"dtype={want.name!r}) to pass it without a copy",
                          stacklevel=user_stacklevel())
        d = self._scratch_data(("cast", i), want, value.shape)
        d.minibatch = value.minibatch
        if value.size:
            np.copyto(d.data, value.data, casting="unsafe")
        return d

    def _scratch_data(self, key, dtype, shape):
        return fit_scratch(self._scratch, key, dtype, shape, f"{self.name}:{key}")

    # -- the call ----------------------------------------------------------

    @context.serialized
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 device_outputs=False, **kwargs):
        """Run data-parallel: scatter inputs, compute everywhere, reduce outputs.

        Args:
            *args: one value per input (numpy arrays, array-likes or
                synk.data), in order. Dtypes follow PyTensor's rule: a value
                whose dtype casts to the input's without loss is cast (also a
                synk.data, copied into shared memory on every call, with a
                warning the first time: make it with the input's dtype to
                avoid the copy); any other is a TypeError.
            **kwargs: input values by input name.
            output_subset: indices of the outputs to compute and return (a
                list of ints).
            batch: rows of the scattered inputs to use: an int (the first
                rows), a slice, or a list/array of indices.
            batch_s: rows of the sliceable shared variables: a slice or an
                index list used by every process, or a list of those with one
                entry per process (rank order).
            num_slices: each process accumulates over this many slices of its
                rows (saves memory); updates accumulate with their op.
            device_outputs: on a GPU device, return the outputs as JAX arrays
                on the master's GPU instead of numpy arrays (for chaining GPU
                work). On a CPU device outputs are numpy arrays either way.

        Returns:
            The reduced outputs: a list for a list of outputs (or with
            ``output_subset``), one array for a single output.

        Raises:
            TypeError: an input of the wrong ndim or dtype (as in PyTensor),
                or a bad keyword value, named in the message.
            ValueError, IndexError: bad inputs or rows, named in the message.
            WorkerError or the worker's own exception type: a process failed.
                Every process whose own share ran without error has applied its
                updates; one whose share raised has applied none (a note on the
                exception names the ranks of each). Across nodes the same holds
                in every process of every node.
        """
        plannable = _plannable(kwargs, output_subset, batch, batch_s, num_slices, device_outputs)
        s = context.current()
        # across nodes: a call that fails here before its step reached the others still takes it
        before = None if s is None or s is not self._owner else nodes.steps_begun(s.proc)
        try:
            if plannable and self._planned and self._owner is s:
                plan = self._planned.get(self._plan_key(args))
                if plan is not None:
                    return self._call_planned(plan, args)
            return self._call(args, kwargs, output_subset, batch, batch_s, num_slices, device_outputs, plannable)
        except Exception as err:
            if before is not None and os.getpid() == s.pid:  # (never in a child the user forked)
                nodes.failed_step(s, before, f"call {self.name}", err)
            raise

    def _call(self, args, kwargs, output_subset, batch, batch_s, num_slices, device_outputs, plannable):
        """A call, checked and prepared from scratch (and planned for the next
        calls of the same kind when it can be)."""
        s = context.session()
        if self._owner is not s:
            raise SynkError(
                f"function {self.name!r} was built for a fork that was closed (synk.close()); "
                "build it again with synk.function() after this synk.fork()")
        s.usable()
        self._planned.clear()  # this call may move scratch memory that a plan writes into
        spec = self._spec
        batch_s = self._check_batch_s(batch_s, s.n_parallel)
        if isinstance(num_slices, bool) or not isinstance(num_slices, (int, np.integer)) or num_slices < 1:
            raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
        if not isinstance(device_outputs, bool):
            raise TypeError(f"device_outputs must be True or False, got {device_outputs!r}")
        subset = self._check_subset(output_subset)
        if num_slices > 1:
            self._check_sliceable_outputs(subset)
        values = [self._check_value(i, v) for i, v in enumerate(self._bind(args, kwargs))]
        n_rows, norm_batch = self._rows(values, batch)
        if self._spec.fid not in s.distributed:
            distribute()
        own: dict = {}
        refs = []
        me = s.proc.rank
        for i, value in enumerate(values):
            if spec.bcast[i]:
                if isinstance(value, Data):
                    refs.append(("b", data_ref(value)))
                else:
                    own[i] = value
                    refs.append(("b", self._scratch_fill_whole(i, value)))
            elif isinstance(value, Data):
                refs.append(("m" if value.minibatch else "s", data_ref(value)))
            else:
                own[i], ref = self._scatter_numpy(i, value, norm_batch, n_rows, me, s.n_parallel)
                refs.append(("m", ref))
        batch_ref = norm_batch
        if isinstance(norm_batch, np.ndarray):
            d = self._scratch_data("batch", np.int64, norm_batch.shape)
            d.data[...] = norm_batch
            batch_ref = data_ref(d)
        inline = self._inline(s.proc, subset)
        call = CallSpec(spec.fid, refs, batch_ref, n_rows, int(num_slices), subset, batch_s, inline)
        wire = call.to_wire()
        if plannable:
            self._plan(args, values, call, wire, own)
        results = s.run(Command.CALL, wire, local=lambda proc, _: execute_call(proc, call, own))
        return self._finish(s, call, results, device_outputs)

    def _finish(self, s, call, results, device_outputs):
        """The call's results as the user gets them, from what the master's share returned."""
        if call.inline:
            results, spilled = combine_inline(s.proc, results, self._local.plan(s.proc, call.subset)[0])
            if spilled:  # outputs this big reduce faster through the communicator
                self._spilled.add(call.subset)
                self._planned.clear()
        results = s.proc.device.to_user(results, device_outputs)
        if call.subset is not None:
            return results
        return self._shape_result(results)

    # -- planned calls -----------------------------------------------------
    #
    # A training or evaluation loop calls a function again and again with
    # inputs of the same shapes. The first such call is checked and prepared
    # in full; what it sends is kept (the message, pickled; where each numpy
    # input's rows go), and the next calls with inputs of the same kinds and
    # shapes only copy the rows and send the same bytes, which the workers do
    # not even unpickle again.

    def _plan_key(self, args):
        """What a planned call must match: per input its shape (a numpy array of
        the input's dtype and ndim) or its synk.data ref; None when a value
        needs the full checks."""
        if len(args) != len(self._types):
            return None
        key = []
        for value, (dtype, ndim, plain) in zip(args, self._types):
            if type(value) is np.ndarray:
                if not plain or value.dtype != dtype or value.ndim != ndim or not value.flags.aligned:
                    return None
                key.append(value.shape)
            elif isinstance(value, Data):
                if value.dtype != dtype or value.ndim != ndim:
                    return None
                key.append((data_ref(value), value.minibatch))
            else:
                return None
        return tuple(key)

    def _plan(self, args, values, call, wire, own) -> None:
        """Keep what this call sends, for the next calls with inputs like ``args``."""
        key = self._plan_key(args)
        if key is None or any(v is not a for v, a in zip(values, args)):
            return  # a value was converted: the checks must run every time
        copies, mine = [], []
        for i in range(len(args)):
            if not isinstance(args[i], np.ndarray):
                continue
            kind, ref = call.inputs[i]
            rows = None if kind == "b" else split(call.n_rows, self._owner.n_parallel, self._owner.proc.rank)
            mine.append((i, None if rows is None else slice(*rows)))
            if ref is not None:
                d = self._scratch[i]
                if oversized(d.alloc_size * d.dtype.itemsize, d.size * d.dtype.itemsize):
                    return  # left by a larger call: the full path counts the uses that shrink it
                dst = d.data
                # a broadcast input is copied whole (``...``: also a 0-d one), a scattered one
                # without the master's own rows
                pieces = [...] if rows is None else [slice(lo, hi) for lo, hi in ((0, rows[0]), (rows[1], call.n_rows))
                                                     if hi > lo]
                copies.append((i, dst, pieces))
        proc = self._owner.proc
        share = share_of(proc, call, keep=True, own_keys=own.keys())
        self._planned.keep(key, _Plan(call, wire, pickle.dumps(([], wire), protocol=pickle.HIGHEST_PROTOCOL),
                                 copies, mine, share if share.fn is not None else None,
                                 Lane.of(proc, call, share)))

    def _call_planned(self, plan, args):
        s = context.session()
        for i, dst, pieces in plan.copies:
            value = args[i]
            for rows in pieces:
                dst[rows] = value[rows]
        call, lane = plan.call, plan.lane
        if lane is not None:
            own = [(i, args[i] if rows is None else args[i][rows]) for i, rows in plan.mine]
            outs, mine = s.run(Command.CALL, plan.wire, body=plan.body, local=lambda proc, _: lane.run(proc, own))
            results = lane.combine(outs, mine)
            if results is None:  # out of the ordinary: the general path sorts it out
                return self._finish(s, call, (outs, mine, lane.weight), False)
            return self._shape_result(s.proc.device.to_user(results, False))
        own = {i: args[i] if rows is None else args[i][rows] for i, rows in plan.mine}
        results = s.run(Command.CALL, plan.wire, body=plan.body,
                        local=lambda proc, _: execute_call(proc, call, own, plan.share))
        return self._finish(s, call, results, False)

    def _inline(self, proc, subset) -> bool:
        """Whether this call's outputs ride back with the workers' answers
        (small, host arrays, every communicator within the fork) instead of
        going through a collective."""
        if subset in self._spilled:
            return False
        return all(comm.within_fork and not comm.device_arrays
                   for _, comm, _ in self._local.plan(proc, subset)[1])

    def _rows(self, values, batch) -> tuple:
        """``(n_rows, norm_batch)`` of a call: the rows the scattered inputs give
        (None without scattered inputs) and ``batch`` normalised."""
        scattered = [i for i, b in enumerate(self._spec.bcast) if not b]
        n_rows, norm_batch = None, None
        if scattered:
            full = [len(values[i]) if not _is_minibatch(values[i]) else None for i in scattered]
            lengths = [n for n in full if n is not None]
            if batch is None and len(set(lengths)) > 1:
                names = [self._input_names[i] for i in scattered]
                raise ValueError(f"scattered inputs of function {self.name!r} differ in length: "
                                 f"{dict(zip(names, full))}")
            ref_len = min(lengths) if lengths else min(len(values[i]) for i in scattered)
            norm_batch = check_batch(batch, ref_len)
            n_rows = batch_length(norm_batch, ref_len)
            short = [self._input_names[i] for i in scattered
                     if _is_minibatch(values[i]) and len(values[i]) < n_rows]
            if short:
                raise ValueError(f"minibatch inputs {short} hold fewer rows than the {n_rows} asked for")
        elif batch is not None:
            raise ValueError(f"batch={batch!r} given, but function {self.name!r} has no scattered inputs")
        return n_rows, norm_batch

    def _scratch_fill_whole(self, i, value):
        if context.session().n_parallel == 1:
            return None  # nobody else reads it
        d = self._scratch_data(i, value.dtype, value.shape)
        if value.size:
            np.copyto(d.data, value)
        return data_ref(d)

    def _scatter_numpy(self, i, value, batch, n_rows, me, n):
        """Copy the other processes' rows of a numpy input to shared memory; keep ours."""
        if n == 1:
            return value if batch is None else value[sub_batch(batch, 0, n_rows)], None
        d = self._scratch_data(i, value.dtype, (n_rows,) + value.shape[1:])
        dst = d.data
        my_lo, my_hi = split(n_rows, n, me)
        for lo, hi in ((0, my_lo), (my_hi, n_rows)):
            if hi > lo:
                sel = sub_batch(batch, lo, hi)
                if isinstance(sel, slice):
                    dst[lo:hi] = value[sel]
                else:
                    np.take(value, sel, axis=0, out=dst[lo:hi])
        return value[sub_batch(batch, my_lo, my_hi)], data_ref(d)

    def _check_batch_s(self, batch_s, n):
        """None, or one selection per rank (each None, a slice or an int64 array)."""
        if batch_s is None:
            return None
        if not self._spec.sliceable:
            raise TypeError(f"function {self.name!r} has no sliceable shared variables; "
                            f"batch_s must be None, got {batch_s!r}")
        per_rank = isinstance(batch_s, (list, tuple)) and len(batch_s) > 0 and all(
            b is None or isinstance(b, (slice, list, tuple, np.ndarray)) for b in batch_s)
        items = list(batch_s) if per_rank else [batch_s] * n
        if per_rank and len(items) != n:
            raise ValueError(f"batch_s has {len(items)} entries, one per process expected ({n})")
        out = []
        for item in items:
            if item is None or isinstance(item, slice):
                check_batch(item, 1 << 62)
                out.append(item)
            elif isinstance(item, (list, tuple, np.ndarray)):
                arr = np.asarray(item)
                if arr.size == 0:
                    arr = arr.astype(np.int64)
                if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                    raise TypeError(f"batch_s entries must be slices or 1-d integer index lists, got {item!r}")
                out.append(arr.astype(np.int64))
            else:
                raise TypeError(f"batch_s must be a slice, an index list, or a list of those "
                                f"(one per process), got {item!r}")
        return out

    def _check_sliceable_outputs(self, subset) -> None:
        """With ``num_slices`` > 1, refuse 0-d outputs that keep every process's value
        (``gather``, ``None``): a process would have one value per slice instead of one."""
        spec = self._spec
        if all(spec.bcast) and not spec.sliceable:
            return  # nothing is split into slices
        chosen = range(len(spec.outputs)) if subset is None else subset
        flat = [spec.outputs[k].name or f"#{k}" for k in chosen
                if spec.output_ops[k] in (None, "gather") and spec.outputs[k].type.ndim == 0]
        if flat:
            raise ValueError(f"outputs {flat} of function {self.name!r} are 0-d with op 'gather' or None: "
                             "with num_slices > 1 each process would have one value per slice instead "
                             "of one value; use num_slices=1 or a reducing op for them")

    def _check_subset(self, output_subset):
        if output_subset is None:
            return None
        n = len(self._spec.outputs)
        if not isinstance(output_subset, (list, tuple, range, np.ndarray)):
            raise TypeError(f"output_subset must be a list of output indices, got {output_subset!r}")
        wrong = [k for k in output_subset if isinstance(k, (bool, np.bool_))
                 or not isinstance(k, (int, np.integer))]
        if wrong:
            raise TypeError(f"output_subset must hold int output indices, got {wrong[0]!r} "
                            f"in {output_subset!r}")
        subset = tuple(int(k) for k in output_subset)
        bad = [k for k in subset if not 0 <= k < n]
        if bad:
            raise IndexError(f"output_subset {list(output_subset)} names outputs {bad}; "
                             f"function {self.name!r} has {n} outputs")
        return subset

    def _shape_result(self, results):
        if self._spec.returns_list:
            return list(results)
        return results[0]


_MISSING = object()


def _plannable(kwargs, output_subset, batch, batch_s, num_slices, device_outputs) -> bool:
    """Whether a call's keywords let it be planned (inputs in order, all of them, whole)."""
    return (not kwargs and output_subset is None and batch is None and batch_s is None
            and type(num_slices) is int and num_slices == 1 and device_outputs is False)


@dataclasses.dataclass
class _Plan:
    """What a call sends, kept for the next calls with inputs of the same kinds and shapes."""

    call: CallSpec
    wire: tuple
    body: bytes      # ([], wire) pickled
    copies: list     # (input, scratch array, [(lo, hi) rows to copy]) per numpy input others read
    mine: list       # (input, slice of the master's rows or None for all) per numpy input
    share: Share | None  # the master's share, kept
    lane: Lane | None    # the master's share as a lane, where it can run as one


def _is_minibatch(value) -> bool:
    return isinstance(value, Data) and value.minibatch


def function(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
             sliceable_shareds=None, reduce_ops=None, broadcast_inputs=None,
             **pytensor_kwargs) -> Function:
    """Build a data-parallel function, compiled here and in every worker.

    Args:
        inputs: list of PyTensor variables.
        outputs: a variable, a list of variables, or ``(variable, op)`` pairs;
            op is one of ``avg`` (default), ``sum``, ``prod``, ``max``,
            ``min``, ``gather``, ``None`` (master's own result, on its own
            rows: with fewer rows than processes, on none), optionally
            ``c_``-prefixed.
        bcast_inputs: inputs (variables or positions) every worker gets whole;
            the others are scattered along axis 0. A variable not listed in
            ``inputs`` is appended to them, as the original Synkhronos did.
        broadcast_inputs: the original Synkhronos's name for ``bcast_inputs``.
        updates: ``(shared, expression)`` or ``(shared, expression, op)``
            pairs, or a dict; applied locally in each process.
        givens: as for ``pytensor.function``.
        sliceable_shareds: shared variables whose rows a call may select with
            ``batch_s`` in each process's own copy.
        reduce_ops: one op for every output, or one per output (instead of pairs).
        nccl: on a GPU device where every process has a GPU of its own, reduce
            this function's outputs through NCCL (default); ``False`` takes
            the CPU (shared-memory) path, as ``c_`` ops do for one output.
        **pytensor_kwargs: passed to ``pytensor.function`` (``mode``, ...).
            On a GPU device ``mode`` defaults to ``"JAX"``.

    Returns:
        A :class:`Function`.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError, ValueError: bad arguments, named in the message.
    """
    s = context.session()
    s.usable()
    inputs = _check_inputs(inputs, pytensor_kwargs)
    outs, ops, given_ops, returns_list = _parse_outputs(outputs, reduce_ops)
    _warn_averaged_log_probability(outs, ops)
    upd_pairs, upd_ops = _parse_updates(updates)
    inputs, bcast = _parse_bcast(inputs, bcast_inputs, broadcast_inputs)
    sliceable = _parse_sliceable(sliceable_shareds)

    nccl = pytensor_kwargs.pop("nccl", True)
    if not isinstance(nccl, bool):
        raise TypeError(f"nccl must be True or False, got {nccl!r}")
    if s.proc.device.default_mode is not None:  # GPU: JAX, the graph runs on this process's GPU
        pytensor_kwargs.setdefault("mode", s.proc.device.default_mode)
    fid = context.next_function_id()
    name = pytensor_kwargs.pop("name", None) or f"synk_function_{fid}"
    spec = FunctionSpec(fid, name, inputs, outs, ops, upd_pairs, upd_ops, givens,
                        dict(pytensor_kwargs), tuple(bcast), sliceable, returns_list, given_ops,
                        nccl=nccl)
    local = LocalFunction(spec)
    local.compiled()  # compile now, as pytensor.function does: errors show here
    fn = Function(spec, local)
    fn._owner = s
    fn._planned = s.proc.kept.calls_of(fid)
    local.node_identity = nodes.function_identity(s.proc, spec, lambda: graph_digest(local))  # (None on one node)
    s.proc.functions[fid] = local
    return fn


def _check_inputs(inputs, pytensor_kwargs) -> list:
    """function()'s inputs as a list; call keywords given to function() refused."""
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of PyTensor variables, got {inputs!r}")
    bad = [item for item in inputs if not isinstance(item, Variable)]
    if bad:
        raise TypeError(f"inputs must be PyTensor variables, got {bad[0]!r} in inputs")
    inputs = list(inputs)
    for key in ("outputs_subset", "output_subset"):
        if key in pytensor_kwargs:
            raise TypeError(f"{key} is a call keyword, not a function keyword")
    return inputs


def _parse_outputs(outputs, reduce_ops) -> tuple:
    """``(outs, ops, given_ops, returns_list)``: the output variables, their ops
    (checked, without ``c_``), the ops as given, and whether a call returns a list."""
    returns_list = isinstance(outputs, (list, tuple))
    if outputs is None:
        out_items = []
        returns_list = True
    elif returns_list:
        out_items = list(outputs)
        if len(out_items) == 2 and isinstance(out_items[0], Variable) and not isinstance(out_items[1], Variable) \
                and isinstance(outputs, tuple):
            out_items, returns_list = [tuple(outputs)], False
    else:
        out_items = [outputs]
    outs, ops = [], []
    for item in out_items:
        if isinstance(item, tuple):
            if len(item) != 2:
                raise TypeError(f"an output pair must be (variable, op), got {item!r}")
            var, op = item
        else:
            var, op = item, "avg"
        if not isinstance(var, Variable):
            raise TypeError(f"outputs must be PyTensor variables, got {var!r}")
        outs.append(var)
        ops.append(op)
    if reduce_ops is not None:
        if isinstance(reduce_ops, (list, tuple)):
            if len(reduce_ops) != len(outs):
                raise ValueError(f"reduce_ops has {len(reduce_ops)} entries for {len(outs)} outputs")
            ops = list(reduce_ops)
        else:
            ops = [reduce_ops] * len(outs)
    given_ops = list(ops)
    ops = [None if op is None else check_op(op, OUTPUT_OPS, "output op") for op in ops]
    return outs, ops, given_ops, returns_list


#: Output names that say "a log-probability summed over rows": averaging one is a likely slip.
_LOG_PROBABILITY = re.compile(r"(?i)(^|[^a-z])(logp|log_?prob|log_?lik|loglike|log_?likelihood|"
                              r"log_?density|elbo)([^a-z]|$)")


def _warn_averaged_log_probability(outs, ops) -> None:
    """A warning (Python shows it once per place) for an output named like a
    log-probability and reduced with "avg": a likelihood over rows is a sum."""
    for var, op in zip(outs, ops):
        if op == "avg" and var.name and _LOG_PROBABILITY.search(var.name):
            warnings.warn(f"output {var.name!r} looks like a log-probability and is reduced with 'avg' "
                          "(the default): across processes that is a mean of the processes' values "
                          "weighted by their rows, not the log-probability of all rows; give "
                          f"({var.name}, 'sum') for a sum over rows", stacklevel=user_stacklevel())


def _parse_updates(updates) -> tuple:
    """``(pairs, ops)``: ``(shared, expression)`` pairs and their ops (checked)."""
    upd_pairs, upd_ops = [], []
    if updates is not None:
        items = list(updates.items()) if isinstance(updates, dict) else list(updates)
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise TypeError(f"an update must be (shared, expression) or (shared, expression, op), got {item!r}")
            var, expr = item[0], item[1]
            op = item[2] if len(item) == 3 else "avg"
            if not hasattr(var, "get_value"):
                raise TypeError(f"update target must be a shared variable, got {var!r}")
            upd_pairs.append((var, expr))
            upd_ops.append(check_op(op, what="update op"))
    return upd_pairs, upd_ops


def _parse_bcast(inputs, bcast_inputs, broadcast_inputs) -> tuple:
    """``(inputs, bcast)``: the inputs (a broadcast variable not among them appended)
    and, per input, whether every process gets it whole."""
    if broadcast_inputs is not None:
        if bcast_inputs is not None:
            raise TypeError("give bcast_inputs or its alias broadcast_inputs, not both")
        bcast_inputs = broadcast_inputs
    if bcast_inputs is not None and not isinstance(bcast_inputs, (list, tuple)):
        bcast_inputs = [bcast_inputs]
    for b in bcast_inputs or ():
        if isinstance(b, Variable) and all(v is not b for v in inputs):
            inputs.append(b)
    bcast = [False] * len(inputs)
    for b in bcast_inputs or ():
        if isinstance(b, (int, np.integer)) and not isinstance(b, bool):
            if not 0 <= b < len(inputs):
                raise IndexError(f"bcast_inputs position {b} is out of range for {len(inputs)} inputs")
            bcast[b] = True
            continue
        pos = [i for i, v in enumerate(inputs) if v is b]
        if not pos:
            raise ValueError(f"bcast_inputs entry {b!r} is not one of the function's inputs")
        bcast[pos[0]] = True
    for i, v in enumerate(inputs):
        if not bcast[i] and v.type.ndim == 0:
            raise ValueError(f"input {v.name or i!r} is 0-d and cannot be scattered; list it in bcast_inputs")
    return inputs, bcast


def _parse_sliceable(sliceable_shareds) -> list:
    """The shared variables whose rows ``batch_s`` may select."""
    sliceable = []
    for var in sliceable_shareds or ():
        if not hasattr(var, "get_value") or not isinstance(var, Variable):
            raise TypeError(f"sliceable_shareds must be shared variables, got {var!r}")
        if var.type.ndim == 0:
            raise ValueError(f"sliceable shared variable {var.name or var!r} is 0-d; it has no rows")
        sliceable.append(var)
    return sliceable
