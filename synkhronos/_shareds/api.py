"""Collectives on PyTensor shared variables: every process holds its own copy.

Master and worker halves sit together here: the public functions validate
their arguments in the master, then one COLLECTIVE command runs
:func:`_run` in every process, which talks only to the Communicator.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable

from .. import _state as context
from .._protocol import across_nodes as nodes
from .._state import command_lock
from .._arrays import byte_bounds, join, overlaps
from .._batching import batch_length, check_batch, split, sub_batch
from ..collectives.inline import fold_into, raise_mismatch, reduced, reducers_for, same_layout
from ..collectives.ops import cast_to, parse_op
from .._protocol.control import Command
from ..errors import short_repr
from .._procs.shmem import SHRINK_BYTES
from ..data import Data, attach, fit_scratch, forget, ref, release_scratch
from .._protocol.distribute import distribute
from .._kept.records import InlineBody, Resolved
from .._kept.plans import (PLANNED_KINDS, keep_plan, keep_worker_plan, planned, planned_gather,
                           planned_reduce, resolve_key)

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "set_value", "get_value", "get_lengths", "get_shapes"]


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


# ---------------------------------------------------------------------------
# Master side: validation, then one command.


def _as_list(shared_vars):
    single = not isinstance(shared_vars, (list, tuple))
    items = [shared_vars] if single else list(shared_vars)
    if not items:
        raise ValueError("no shared variables given")
    return items, single


def _resolve(shared_vars):
    """Shared variables -> (session, vars, sids, single); errors name the variable.

    What it found is kept per argument (by the identity of the variables,
    which the kept entry keeps alive): a loop of collectives resolves once."""
    s = context.session()
    s.usable()
    key = resolve_key(shared_vars)
    got = s.proc.kept.resolved.get(key)
    if got is not None:
        if len(s.distributed) != len(s.proc.functions):  # distributed only ever holds functions' ids
            distribute()
        return (s,) + got
    items, single = _as_list(shared_vars)
    for v in items:
        if not isinstance(v, SharedVariable):
            raise TypeError(f"expected PyTensor shared variables, got {v!r}")
    if len(s.distributed) != len(s.proc.functions):  # distributed only ever holds functions' ids
        distribute()
    sids = []
    for v in items:
        sid = s.shared_ids.get(id(v))
        if sid is None:
            raise ValueError(f"shared variable {v.name or v!r} is used by no distributed synkhronos "
                             "function, so the workers do not hold it")
        sids.append(sid)
    if len(set(sids)) != len(sids):
        twice = [v.name or repr(v) for k, v in enumerate(items) if sids.index(sids[k]) != k]
        raise ValueError(f"shared variables {twice} are listed more than once; list each once "
                         "(a collective would act on it once per listing)")
    if key is not None:
        s.proc.kept.resolved.keep(key, Resolved(items, sids, single))
    return s, items, sids, single


def _values_for(vars_, values, what: str, single: bool = False):
    # one variable given bare takes its value whole, nested Python lists included
    if single or not isinstance(values, (list, tuple)) \
            or (len(vars_) == 1 and not _is_value_list(values, vars_[0])):
        values = [values]
    if len(values) != len(vars_):
        raise ValueError(f"{what}: {len(values)} values for {len(vars_)} shared variables")
    out = []
    for var, value in zip(vars_, values):
        arr = value.data if isinstance(value, Data) else value
        # PyTensor's own rule, as var.set_value applies it: safe casts only, so
        # 1.7 never lands in an int as 1, nor 1e300 in a float32 as inf
        strict = getattr(var.container, "strict", False)
        allow_downcast = getattr(var.container, "allow_downcast", None)
        try:
            out.append(var.type.filter(arr, strict=strict, allow_downcast=allow_downcast))
        except (TypeError, ValueError, OverflowError) as err:
            shown = short_repr(arr, ellipsis="...")
            detail = err.args[0] if err.args else err
            raise type(err)(f"{what}: value {shown} for shared variable {var.name or var!r} "
                            f"({var.type}): {detail}") from None
    return out


def _is_value_list(values, var) -> bool:
    """Whether ``values``, given for a list of the one variable ``var``, is a list of one
    value per variable: its items are arrays, or ``var`` is 0-d, which no list can be
    the value of (``[np.float32(2.5)]`` for ``[z]``); else it is the variable's value."""
    if isinstance(values, np.ndarray) or not len(values):
        return False
    if var.type.ndim == 0 and len(values) == 1:
        return True
    return all(isinstance(v, (np.ndarray, Data, list, tuple)) for v in values)


def _stage(fn_key, arrays):
    """Copy arrays into the session's collective scratch segments; return their refs."""
    s = context.session()
    refs = []
    for i, arr in enumerate(arrays):
        d = fit_scratch(s.collective_scratch, (fn_key, i), arr.dtype, arr.shape, f"collective:{fn_key}:{i}")
        if arr.size:
            np.copyto(d.data, arr)
        refs.append(ref(d))
    return refs


def _unstage(s, fn_key, n) -> None:
    """Release staged values of ``SHRINK_BYTES`` or more once the collective is over
    (the workers drop their mappings as soon as they copied them, see :func:`_run_host`)."""
    release_scratch(s.collective_scratch, [(fn_key, i) for i in range(n)], min_bytes=SHRINK_BYTES)


def _ret(results, single):
    return results[0] if single else tuple(results)


@nodes.stepped("broadcast")
def broadcast(shared_vars, values=None, nccl=True):
    """Give every process the master's value of each shared variable.

    Args:
        shared_vars: one shared variable or a list/tuple of them.
        values: new values (set in the master too) instead of the master's own
            (across nodes: node 0's; the other nodes' are ignored, may be None).
        nccl: on a GPU device, go through NCCL (the default); ``False`` takes
            the CPU (shared-memory) path, as a ``c_`` op does. The same on a CPU device.

    Returns:
        None.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; a value of the wrong ndim, or of a
            dtype the variable cannot hold without loss (PyTensor's ``set_value`` rule);
            ``nccl`` not a bool.
        ValueError: a variable that no distributed function uses; values that do not match the variables in number.
    """
    with command_lock:  # (context.serialized, with the kept plan first: see plans.planned)
        if values is None and planned("broadcast", shared_vars, None, nccl):
            return None
        return _broadcast(shared_vars, values, nccl)


def _broadcast(shared_vars, values, nccl) -> None:
    context.refuse_nested("broadcast")
    cpu = not _check_nccl(nccl)
    s, vars_, sids, single = _resolve(shared_vars)
    if values is not None and nodes.world().node == 0:  # across nodes node 0's values are sent
        # (a bad value raises here; the step still reaches the others: see nodes.stepped)
        for var, val in zip(vars_, _values_for(vars_, values, "broadcast", single)):
            var.set_value(val)
    _send(s, CollectiveSpec("broadcast", sids, cpu=cpu),
          plan_key=None if values is not None else ("broadcast", resolve_key(shared_vars), None, nccl))


@nodes.stepped("scatter")
@context.serialized
def scatter(shared_vars, values, batch=None):
    """Split each value along axis 0 and give each process its part.

    Rows split as evenly as possible, in rank order.

    Args:
        shared_vars: one shared variable or a list/tuple of them.
        values: one array (numpy or synk.data) per variable (across nodes:
            node 0's, split over every process of every node; the other
            nodes may pass None).
        batch: rows of the values to use first (int, slice or index list).

    Returns:
        None.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; a value of the wrong ndim, or of a
            dtype the variable cannot hold without loss (PyTensor's ``set_value`` rule).
        IndexError: ``batch`` beyond the values' rows.
        ValueError: a variable that no distributed function uses; a 0-d value; values that do not match the variables in number.
    """
    s, vars_, sids, single = _resolve(shared_vars)
    # across nodes: node 0's values (the others may pass None)
    arrays = nodes.from_first_node(s.proc, lambda: _values_for(vars_, values, "scatter", single), "scatter",
                                   sids, batch=batch)
    batches = []
    for var, arr in zip(vars_, arrays):
        if arr.ndim == 0:
            raise ValueError(f"scatter: shared variable {var.name or var!r} is 0-d; nothing to split")
        batches.append(check_batch(batch, len(arr)))
    spec = CollectiveSpec("scatter", sids, refs=_stage("scatter", arrays), batch=batches)
    try:
        _send(s, spec)
    finally:
        _unstage(s, "scatter", len(arrays))


@nodes.stepped("gather")
def gather(shared_vars, nd_up=1, nccl=True):
    """Collect every process's value in the master, in rank order.

    Args:
        shared_vars: one shared variable or a list/tuple of them.
        nd_up: 1 stacks the values along a new first axis (equal shapes
            needed); 0 concatenates them along axis 0 (lengths may differ).
        nccl: on a GPU device, go through NCCL (the default); ``False`` takes
            the CPU (shared-memory) path, as a ``c_`` op does. The same on a CPU device.

    Returns:
        An array per variable (a tuple for a list of variables).

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; ``nccl`` not a bool.
        ValueError: a variable that no distributed function uses; ``nd_up`` not 0 or 1; unequal shapes with ``nd_up=1``.
    """
    with command_lock:  # (context.serialized, with the kept plan first: see plans.planned_gather)
        joined = planned_gather(shared_vars, nd_up, nccl)
        if joined is not None:
            return _ret(joined, type(shared_vars) not in (list, tuple))
        return _gather(shared_vars, nd_up, nccl)


def _gather(shared_vars, nd_up, nccl):
    context.refuse_nested("gather")
    if nd_up not in (0, 1) or isinstance(nd_up, bool):
        raise ValueError(f"nd_up must be 0 (concatenate) or 1 (stack), got {nd_up!r}")
    cpu = not _check_nccl(nccl)
    s, vars_, sids, single = _resolve(shared_vars)
    joined = _send(s, CollectiveSpec("gather", sids, nd_up=nd_up, cpu=cpu),
                   plan_key=("gather", resolve_key(shared_vars), nd_up, nccl))
    return _ret(joined, single)


@nodes.stepped("all_gather")
@context.serialized
def all_gather(shared_vars, nccl=True):
    """Concatenate every process's value along axis 0 and store it in every process.

    Args:
        shared_vars: one shared variable or a list/tuple of them (not 0-d).
        nccl: on a GPU device, go through NCCL (the default); ``False`` takes
            the CPU (shared-memory) path, as a ``c_`` op does. The same on a CPU device.

    Returns:
        The new value of each variable (a tuple for a list of variables).

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; ``nccl`` not a bool.
        ValueError: a variable that no distributed function uses; a 0-d variable (use :func:`gather`).
    """
    cpu = not _check_nccl(nccl)
    s, vars_, sids, single = _resolve(shared_vars)
    for v in vars_:
        if v.type.ndim == 0:
            raise ValueError(f"all_gather cannot store the gathered values of 0-d shared variable "
                             f"{v.name or v!r} in it; use gather")
    return _ret(_send(s, CollectiveSpec("all_gather", sids, cpu=cpu)), single)


@nodes.stepped("reduce")
def reduce(shared_vars, op="avg", in_place=True, nccl=True):
    """Combine every process's value with ``op`` into the master.

    Args:
        shared_vars: one shared variable or a list/tuple of them.
        op: ``avg``, ``sum``, ``prod``, ``max`` or ``min`` (``c_`` prefix allowed).
        in_place: store the result in the master's variable; otherwise return
            it and leave the master's variable as it is. Workers' values never change.
        nccl: on a GPU device, go through NCCL (the default); ``False`` takes
            the CPU (shared-memory) path, as a ``c_`` op does. The same on a CPU device.

    Returns:
        The result(s) when ``in_place`` is False, else None: what ``in_place``
        would store, in the variable's dtype (an integer ``avg`` rounded).

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; ``op`` not a string; ``nccl`` not a bool.
        ValueError: a variable that no distributed function uses; an unknown
            ``op``; shapes that differ between processes.
    """
    with command_lock:  # (context.serialized, with the kept plan first: see plans.planned_reduce)
        got = planned_reduce(shared_vars, op, in_place, nccl)
        if got is None:
            return _reduce(shared_vars, op, in_place, nccl)
        if in_place:
            for v, g in zip(_as_list(shared_vars)[0], got):
                _assign(v, g)
            return None
        return _ret(got, type(shared_vars) not in (list, tuple))


def _reduce(shared_vars, op, in_place, nccl):
    context.refuse_nested("reduce")
    name, cpu = parse_op(op)
    cpu = not _check_nccl(nccl) or cpu
    s, vars_, sids, single = _resolve(shared_vars)
    res = _send(s, CollectiveSpec("reduce", sids, op=name, in_place=bool(in_place), cpu=cpu),
                plan_key=("reduce", resolve_key(shared_vars), (op, bool(in_place)), nccl))
    return None if in_place else _ret(res, single)


@nodes.stepped("all_reduce")
def all_reduce(shared_vars, op="avg", nccl=True):
    """Combine every process's value with ``op`` and store the result everywhere.

    Large values are reduced in place, each process working on its own chunk
    of every process's copy.

    Args:
        shared_vars: one shared variable or a list/tuple of them.
        op: ``avg`` (sum times the reciprocal of the count), ``sum``, ``prod``,
            ``max`` or ``min`` (``c_`` prefix allowed).
        nccl: on a GPU device, go through NCCL (the default); ``False`` takes
            the CPU (shared-memory) path, as a ``c_`` op does. The same on a CPU device.

    Returns:
        None.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; ``op`` not a string; ``nccl`` not a bool.
        ValueError: a variable that no distributed function uses; an unknown
            ``op``; shapes that differ between processes.
    """
    with command_lock:  # (context.serialized, with the kept plan first: see plans.planned)
        if planned("all_reduce", shared_vars, op, nccl):
            return None
        return _all_reduce(shared_vars, op, nccl)


def _all_reduce(shared_vars, op, nccl) -> None:
    context.refuse_nested("all_reduce")
    name, cpu = parse_op(op)
    cpu = not _check_nccl(nccl) or cpu
    s, vars_, sids, _ = _resolve(shared_vars)
    _send(s, CollectiveSpec("all_reduce", sids, op=name, cpu=cpu),
          plan_key=("all_reduce", resolve_key(shared_vars), op, nccl))


def _check_nccl(nccl) -> bool:
    if not isinstance(nccl, (bool, np.bool_)):
        raise TypeError(f"nccl must be True or False, got {nccl!r}")
    return bool(nccl)


def _check_rank(s, rank):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an int, got {rank!r}")
    size = s.proc.comm.size  # across nodes: the global size (ranks are global)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range: the fork has ranks 0..{size - 1}")
    return int(rank)


@nodes.stepped("set_value")
@context.serialized
def set_value(rank, shared_vars, values, batch=None):
    """Set the value of shared variables in one process only.

    Args:
        rank: the process (0 .. n_parallel - 1; across nodes a global rank).
        shared_vars: one shared variable or a list/tuple of them.
        values: one array (numpy or synk.data) per variable.
        batch: rows of the values to use (int, slice or index list).

    Returns:
        None.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; a non-int rank; a value of the
            wrong ndim, or of a dtype the variable cannot hold without loss.
        IndexError: ``batch`` beyond the values' rows.
        ValueError: a variable that no distributed function uses; a rank out of range; values that do not match the variables in number.
    """
    s, vars_, sids, single = _resolve(shared_vars)
    rank = _check_rank(s, rank)
    arrays = nodes.from_first_node(s.proc, lambda: _values_for(vars_, values, "set_value", single),
                                   "set_value", sids, rank, batch=batch)
    batches = [check_batch(batch, len(a)) if batch is not None else None for a in arrays]
    if batch is not None and any(a.ndim == 0 for a in arrays):
        raise ValueError("set_value: batch needs values with at least one dimension")
    spec = CollectiveSpec("set_value", sids, rank=rank, refs=_stage("set_value", arrays), batch=batches)
    try:
        _send(s, spec)
    finally:
        _unstage(s, "set_value", len(arrays))


@nodes.stepped("get_value")
@context.serialized
def get_value(rank, shared_vars):
    """The value(s) of shared variables in process ``rank``.

    Args:
        rank: the process (0 .. n_parallel - 1; across nodes a global rank).
        shared_vars: one shared variable or a list/tuple of them.

    Returns:
        A copy of each value (a tuple for a list of variables).

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables; a non-int rank.
        ValueError: a variable that no distributed function uses; a rank out of range.
    """
    s, vars_, sids, single = _resolve(shared_vars)
    rank = _check_rank(s, rank)
    got = _send(s, CollectiveSpec("get_value", sids, rank=rank))
    if len(got) != len(vars_) or any(g is None for g in got):  # across nodes, a node that has joined
        nodes.joined_rank(s.proc, rank, "get_value")
    return _ret(got, single)


@nodes.stepped("get_lengths")
@context.serialized
def get_lengths(shared_vars):
    """Length along axis 0 of each variable in every process.

    Args:
        shared_vars: one shared variable or a list/tuple of them (not 0-d).

    Returns:
        An int array (one entry per rank) per variable; a tuple for a list.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables.
        ValueError: a variable that no distributed function uses; a 0-d variable.
    """
    s, vars_, sids, single = _resolve(shared_vars)
    for v in vars_:
        if v.type.ndim == 0:
            raise ValueError(f"get_lengths: shared variable {v.name or v!r} is 0-d")
    shapes = _send(s, CollectiveSpec("get_shapes", sids))
    return _ret([np.array([sh[0] for sh in per]) for per in shapes], single)


@nodes.stepped("get_shapes")
@context.serialized
def get_shapes(shared_vars):
    """Shape of each variable in every process.

    Args:
        shared_vars: one shared variable or a list/tuple of them.

    Returns:
        A list of shape tuples (one per rank) per variable; a tuple for a list.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: something other than shared variables.
        ValueError: a variable that no distributed function uses.
    """
    s, vars_, sids, single = _resolve(shared_vars)
    return _ret(_send(s, CollectiveSpec("get_shapes", sids)), single)


def on_device(shared_vars):
    """Where every process keeps the values of shared variables (GPU device only).

    Returns, per variable, a boolean array over ranks: True where that
    process holds the value as a device (JAX) array, False where it is in
    host memory. A single variable gives a single array.

    Raises:
        RuntimeError: not a GPU device.
    """
    s, _, sids, single = _resolve(shared_vars)
    if not s.proc.device.keeps_values_on_device:
        raise RuntimeError("on_device() needs a GPU device: synk.fork(device='gpu')")
    got = _send(s, CollectiveSpec("placement", sids))
    return got[0] if single else got


def _assign(var, value) -> None:
    # a reduction's float result lands in an integer variable rounded, never truncated
    var.set_value(cast_to(np.asarray(value), var.type.dtype), borrow=True)


#: Shared-memory homes kept per shared variable. PyTensor may give the old
#: storage of an updated shared variable to another one (in-place ops on an
#: update target): that home is then skipped, never written, until the other
#: variable lets it go. Two homes alternate in a training loop; a third is spare.
#: Only shared variables of distributed functions are checked: a plain
#: master-only PyTensor function that updates a distributed variable together
#: with one no synkhronos function uses could hand that one a home unnoticed.
_HOMES = ("", "b", "c")


def _home(proc, sid, dtype, shape, taken, current=None) -> np.ndarray:
    """A shared-memory array for variable ``sid`` that no other shared variable uses.

    ``current``, if it is one of its homes, is still the variable's value: no
    other variable can have been given it (PyTensor gives away only the old
    storage of a variable it updates, which then holds something else).
    Otherwise the first home that no other shared variable uses; ``taken()``
    lists the memory they use, computed only then. A home is made only when
    every one before it is taken (most variables never need a second), and
    homes of another shape or dtype are given up.
    """
    comm = proc.comm
    first = comm.existing(f"sv{sid}", dtype, shape)
    if current is not None and current is first:  # the usual case: a single home, still the value
        return current
    keys = [f"sv{sid}{h}" for h in _HOMES]
    homes = [first, *(comm.existing(key, dtype, shape) for key in keys[1:])]
    if current is not None and any(current is h for h in homes):
        return current
    ranges, free_key = None, None
    for key, view in zip(keys, homes):
        if view is None:
            free_key = free_key or key
            continue
        if not view.nbytes:
            return view
        if ranges is None:
            ranges = taken()
        if not overlaps(view, ranges):
            return view
    if free_key is None:
        return comm.resident(keys[-1], dtype, shape, fresh=True)
    for key, view in zip(keys, homes):
        if view is None and key != free_key:
            comm.drop_resident(key)
    return comm.resident(free_key, dtype, shape)


def leave_homes(proc) -> None:
    """At close(): copy the master's shared variables out of their homes, so that the
    homes' shared memory goes with the fork and the variables keep their values."""
    comm = proc.comm
    if not comm.supports_resident:
        return
    ranges = comm.resident_ranges()
    for var in proc.shareds.values():
        value = var.container.storage[0]
        if isinstance(value, np.ndarray) and value.nbytes and overlaps(value, ranges):
            var.set_value(np.array(value, copy=True), borrow=True)


def _resident(proc, sids, vars_) -> list:
    """These processes's values of ``vars_``, moved into shared memory the communicator
    can read (and all_reduce write) in place; copied only when an update or
    set_value has replaced a value since the last collective."""
    values = [v.get_value(borrow=True) for v in vars_]
    comm = proc.comm
    if not comm.supports_resident:
        return values
    for sid, a in zip(sids, values):
        if comm.existing(f"sv{sid}", a.dtype, a.shape) is not a:
            break
    else:
        return values  # the usual case in a loop: every value is still its first home
    out = []
    for sid, var, value in zip(sids, vars_, values):
        # what every other variable holds now, those of this collective too (a call that
        # swapped two of them left each holding the other's home; moved ones hold their new)
        view = _home(proc, sid, value.dtype, value.shape, lambda sid=sid: _memory_in_use(proc, exclude={sid}),
                     current=value)
        if view is not value:
            np.copyto(view, value)
            var.set_value(view, borrow=True)
        out.append(view)
    return out


def _receive_into(proc, sid, var, src) -> np.ndarray:
    """Copy ``src`` into this process's shared-memory home for ``var`` and make it the
    value (memory allocated once, not at every broadcast)."""
    current = var.get_value(borrow=True)
    # the value's own dtype object is the variable's: no dtype to build from its name in a loop
    same_dtype = getattr(current, "dtype", None) is src.dtype or np.dtype(src.dtype) == np.dtype(var.type.dtype)
    if not proc.comm.supports_resident or not same_dtype:
        _assign(var, np.array(src, copy=True))
        return var.get_value(borrow=True)
    # _home returns the value itself at once while it is its first home (the usual case in a loop)
    view = _home(proc, sid, src.dtype, src.shape, lambda: _memory_in_use(proc, exclude={sid}), current=current)
    np.copyto(view, src)
    if view is not current:
        var.set_value(view, borrow=True)
    return view


def _memory_in_use(proc, exclude) -> list:
    """Byte ranges of the current values of every other shared variable of this process."""
    ranges = []
    for sid, var in proc.shareds.items():
        if sid in exclude:
            continue
        value = var.container.storage[0]  # the storage itself, never a copy
        if isinstance(value, np.ndarray) and value.nbytes:
            ranges.append(byte_bounds(value))
    return ranges


def _send(s, spec: CollectiveSpec, plan_key=None):
    """Run ``spec`` in every process; the workers get it as a plain tuple (a
    dataclass takes several times longer to pickle, on every collective).
    Small values take the inline path (:func:`_send_inline`), which keeps a
    plan under ``plan_key`` (see :mod:`synkhronos.plans`)."""
    if spec.kind in _INLINE_KINDS:
        got = _send_inline(s, spec, plan_key)
        if got is not _NOT_INLINE:
            return got
    wire = tuple(getattr(spec, f.name) for f in dataclasses.fields(spec))
    return s.run(Command.COLLECTIVE, wire, lambda proc, _: _run(proc, spec))


def worker_collective(proc, wire: tuple):
    if wire[0] is _INLINE:
        kept = proc.kept.worker_plans.get(id(wire))
        if kept is not None and kept.wire is wire and kept.run(proc):
            return None
        _run_inline(proc, *wire[1:])
        if wire[1] in PLANNED_KINDS and proc.control.message_kept:  # (else it never comes again)
            keep_worker_plan(proc, wire)
        return None
    return _run(proc, CollectiveSpec(*wire))


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
_INLINE_KINDS = frozenset(("broadcast", "all_reduce", "reduce", "gather"))
#: What :func:`_send_inline` returns when the collective must take the communicator's path.
_NOT_INLINE = object()


def _inline_body(s, key, layout, values, got):
    """The pickled inline command ``key`` for ``values`` (``got``: the one kept for
    ``key``, if any), or None when they cannot go inline."""
    if got is not None and got.layout == layout:
        return got.body
    for a in values:
        if type(a) is not np.ndarray or not a.dtype.isnative or a.dtype.hasobject:
            return None
    if not s.proc.comm.fits_inline(values):
        return None
    body = pickle.dumps(([], (_INLINE,) + key), protocol=pickle.HIGHEST_PROTOCOL)
    s.proc.kept.bodies.keep(key, InlineBody(body, layout))
    return body


def _send_inline(s, spec: CollectiveSpec, plan_key=None):
    """``spec`` by the inline path, or ``_NOT_INLINE`` when it must take the communicator's;
    a collective that went through keeps its plan under ``plan_key`` (see :mod:`synkhronos.plans`)."""
    proc = s.proc
    comm = proc.comm
    # workers still busy with an abandoned command might read the master's area: the full path settles them first
    if not comm.within_fork or proc.device.keeps_values_on_device or not proc.control.all_answered():
        return _NOT_INLINE
    key = (spec.kind, tuple(spec.sids), spec.op)
    kept = proc.kept.bodies.get(key)
    vars_ = [proc.shareds[sid] for sid in spec.sids]
    values = [v.get_value(borrow=True) for v in vars_]
    if kept is not None and same_layout(values, kept.layout):  # the usual case in a loop
        body, layout = kept
    else:
        layout = tuple((a.dtype, a.shape) for a in values)
        body = _inline_body(s, key, layout, values, kept)
        if body is None:
            return _NOT_INLINE
    kind, wire = spec.kind, (_INLINE,) + key
    if kind in ("broadcast", "all_reduce"):
        comm.put_inline(values, layout)
    if kind == "broadcast":
        s.run(Command.COLLECTIVE, wire, body=body)
        keep_plan(s, plan_key, kind, vars_, layout, None, wire, body)
        return None
    if kind == "all_reduce":
        # the master combines while the workers do: its half runs between post and collect
        done = s.run(Command.COLLECTIVE, wire, lambda p, _: _all_reduce_here(p, key[1], vars_, values, layout,
                                                                            spec.op), body=body)
        if not done:
            raise_mismatch(comm, layout, spec.op)
        keep_plan(s, plan_key, kind, vars_, layout, spec.op, wire, body)
        return None
    s.run(Command.COLLECTIVE, wire, body=body)
    parts = comm.inline_parts(values, layout if kind == "reduce" else None)
    if parts is None:
        if kind == "gather":  # a worker's values did not fit (unequal lengths): the communicator's path
            return _NOT_INLINE
        raise_mismatch(comm, layout, spec.op)
    if kind == "gather":
        got = [join([p[i] for p in parts], spec.nd_up, v) for i, v in enumerate(vars_)]
        # (the workers' values may differ in shape from the master's: the plan maps each as it is)
        keep_plan(s, plan_key, kind, vars_, layout, spec.nd_up, wire, body,
                  peer_layouts=[tuple((a.dtype, a.shape) for a in p) for p in parts])
        return got
    got = _inline_reduce(proc, parts, spec, vars_)
    keep_plan(s, plan_key, kind, vars_, layout, spec.op, wire, body)
    return got


def _inline_reduce(proc, parts, spec: CollectiveSpec, vars_) -> list:
    """The master's reduce of the values in ``parts`` (per rank, in rank order)."""
    got = [reduced(proc, spec.op, [p[i] for p in parts], v.type.dtype) for i, v in enumerate(vars_)]
    if spec.in_place:
        for v, g in zip(vars_, got):
            _assign(v, g)
    return got


def _all_reduce_here(proc, sids, vars_, values, layout, op) -> bool:
    """One process's half of an inline all_reduce, once its values are in its
    area; False, changing nothing, when some process's values differ in layout."""
    comm = proc.comm
    if proc.is_master:
        comm.inline_await()
    else:
        comm.inline_arrive()
    parts = comm.inline_parts(values, layout)
    if parts is None:
        return False
    homes = _resident(proc, sids, vars_)
    if any(h is not v for h, v in zip(homes, values)):
        # a value moved into its home: the move may have overwritten another of ``values`` (a
        # call that swapped two variables left one holding the other's home), so this process's
        # part is read from its inline area, which holds them as they were
        parts[comm.rank] = comm.inline_values(comm.rank)
    fold_into(homes, parts, *reducers_for(proc, op, homes))
    return True


def _run_inline(proc, kind, sids, op) -> None:
    """A worker's half of an inline collective."""
    comm = proc.comm
    vars_ = [proc.shareds[sid] for sid in sids]
    if kind == "broadcast":
        for sid, var, src in zip(sids, vars_, comm.inline_values(proc.master_rank)):
            _receive_into(proc, sid, var, src)
        return
    # a gather's or reduce's values move into their homes (once), where the master can read them directly next time
    values = [v.get_value(borrow=True) for v in vars_] if kind == "all_reduce" else _resident(proc, sids, vars_)
    layout = tuple((a.dtype, a.shape) for a in values)
    comm.put_inline(values, layout)
    if kind == "all_reduce":  # values of another layout change nothing: the master raises, naming them
        _all_reduce_here(proc, sids, vars_, values, layout, op)


def _run(proc, spec: CollectiveSpec):
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
        comm.broadcast(_resident(proc, spec.sids, vars_) if proc.is_master else None, root=root,
                       receive=lambda i, src: _receive_into(proc, spec.sids[i], vars_[i], src))
    elif kind in ("scatter", "set_value"):
        _host_scatter(proc, spec, vars_)
    elif kind == "gather":
        # (across nodes, a node that has joined gives no parts: it is left out, as in a call)
        return comm.gather(_resident(proc, spec.sids, vars_), root=root,
                           join=lambda i, parts: join([p for p in parts if p is not None], spec.nd_up, vars_[i]))
    elif kind == "all_gather":
        got = comm.all_gather(_resident(proc, spec.sids, vars_))  # read in place, not via the slot
        out = []
        for v, parts in zip(vars_, got):
            joined = np.concatenate([p for p in parts if p is not None], axis=0)
            _assign(v, joined)
            out.append(joined)
        # the caller's arrays are new memory, never the variables' own values
        return [np.array(a, copy=True) for a in out] if proc.is_master else None
    elif kind == "reduce":
        got = comm.reduce(_resident(proc, spec.sids, vars_), spec.op, root=root)
        if got is not None and proc.is_master:
            got = [np.asarray(cast_to(np.asarray(g), v.type.dtype)) for g, v in zip(got, vars_)]
            if spec.in_place:
                for v, g in zip(vars_, got):
                    _assign(v, g)
            return got
    elif kind == "all_reduce":
        arrays = _resident(proc, spec.sids, vars_)
        got = comm.all_reduce(arrays, spec.op, in_place=True)
        for v, g in zip(vars_, got):
            if v.get_value(borrow=True) is not g:
                _assign(v, g)
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
        _assign(v, np.array(arr, copy=True))
    # large staged values are used once: drop the mapping now (the master frees them)
    forget(proc, [ref[0] for ref in spec.refs
                  if math.prod(ref[3]) * np.dtype(ref[2]).itemsize >= SHRINK_BYTES])
