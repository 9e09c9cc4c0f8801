"""What every process holds of a synk.function: its specification, a call's
specification, and the compiled function with its slicing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytensor

from .. import _state as state
from .._arrays import concat
from .._batching import split
from ..collectives.ops import cast_to, combine, result_dtype
from ..devices.jax_state import host_mode, jax_linker
from .._integrations.jax_dtypes import typed_jax_mode

__all__ = []


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


def is_jax_mode(mode) -> bool:
    """Whether PyTensor ``mode`` (a name, a Mode, or None for the default) runs through JAX."""
    try:
        linker = pytensor.compile.mode.get_mode(mode).linker
    except Exception:  # a mode PyTensor does not know: pytensor.function will say so
        return False
    return jax_linker(linker)


class LocalFunction:
    """One process's compiled copies of a function, and how it runs its share."""

    #: Across nodes: the function's identity (``across_nodes.function_identity``), set
    #: by synk.function in the master (None on one node).
    node_identity: tuple | None

    def __init__(self, spec: FunctionSpec):
        self.spec = spec
        self._compiled: dict[tuple, Any] = {}
        self._plans: dict[tuple | None, tuple] = {}

    def compiled(self, subset=None, values=False, sliced=False):
        """The PyTensor function for an output subset.

        ``values`` returns the update values instead of applying them;
        ``sliced`` takes one more input, the rows of the sliceable shared
        variables to use. Inside an XLA host callback a function of JAX mode
        is compiled again without JAX (``host_mode``): JAX cannot run there.
        """
        host = state.in_xla_callback() and is_jax_mode(self.spec.kwargs.get("mode"))
        key = (subset, values, sliced, host)
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
            jax_mode = is_jax_mode(kwargs.get("mode"))
            if host:
                kwargs, jax_mode = {**kwargs, "mode": host_mode()}, False
            if state.jax_inherited and jax_mode:
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
        outs_parts: list[list] = [[] for _ in range(n_out)]
        upd_parts: list[list] = [[] for _ in spec.updates]
        weights: list[int] = []
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


def _all_same(parts) -> bool:
    """Whether every part is the first's bits (shape, dtype and bytes; a NaN equals the same
    NaN), compared without a copy, a prefix first (slices of row-dependent values differ early)."""
    first = np.asarray(parts[0])
    if first.dtype.hasobject:
        return False
    a = np.ascontiguousarray(first).reshape(-1).view(np.uint8)
    for part in parts[1:]:
        part = np.asarray(part)
        if part.dtype != first.dtype or part.shape != first.shape:
            return False
        b = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        if not (np.array_equal(a[:64], b[:64]) and np.array_equal(a, b)):
            return False
    return True


def _accumulate(parts, op, weights, var):
    """One process's value of an output (or update) from its slices' values.

    Reductions combine the slices as they combine processes. An ``avg`` whose
    slices all hold the very same value (one the rows do not change: a step
    counter's ``t + 1``, a shared value) is that value: weights of unequal row
    counts, as fractions rounded in the dtype, need not add up to exactly 1
    (a float32 ``t + 1`` over slices of 4 and 3 rows came back 1 ulp off, and
    differently in each process). ``gather`` and ``None`` keep every row: the
    slices' rows joined in order, which is the unsliced result only for an
    output with one row per input row; anything else is refused, never
    returned different from the unsliced call.
    """
    if op == "avg" and _all_same(parts):  # (in avg's result dtype: float64 for integers, as combine's)
        first = np.asarray(parts[0])
        return first.astype(result_dtype(first.dtype, op), copy=True)
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
