"""Collectives on PyTensor shared variables: every process holds its own copy.

The public functions validate their arguments in the master, then one
COLLECTIVE command runs :func:`.host.run` in every process, which talks only
to the Communicator.
"""

from __future__ import annotations

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable

from .. import _state as state
from .._protocol import across_nodes as nodes
from .._state import command_lock
from .._batching import check_batch
from ..collectives.ops import parse_op
from ..errors import short_repr
from .._procs.shmem import SHRINK_BYTES
from ..data import Data, ref
from .._protocol.scratch import fit_scratch, release_scratch
from .._protocol.distribute import distribute
from .._kept.records import Resolved
from .._kept.plans import keep_comm_plan, keep_node_plan, planned, planned_gather, planned_reduce, resolve_key
from ..world import world
from .homes import assign, receive_into, spare_home
from .host import CollectiveSpec, send, wire_of

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "set_value", "get_value", "get_lengths", "get_shapes"]


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
    s = state.running_session()
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
    s = state.running_session()
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
    with command_lock:  # (state.serialized, with the kept plan first: see plans.planned)
        if values is None and planned("broadcast", shared_vars, None, nccl):
            return None
        return _broadcast(shared_vars, values, nccl)


def _broadcast(shared_vars, values, nccl) -> None:
    state.refuse_nested("broadcast")
    cpu = not _check_nccl(nccl)
    s, vars_, sids, single = _resolve(shared_vars)
    if values is not None and world().node == 0:  # across nodes node 0's values are sent
        # (a bad value raises here; the step still reaches the others: see nodes.stepped)
        for var, val in zip(vars_, _values_for(vars_, values, "broadcast", single)):
            var.set_value(val)
    spec = CollectiveSpec("broadcast", sids, cpu=cpu)
    plan_key = None if values is not None else ("broadcast", resolve_key(shared_vars), None, nccl)
    send(s, spec, plan_key=plan_key)
    proc = s.proc
    if plan_key is not None and plan_key[1] is not None and proc.size == 1:  # a fork of one process
        # (across nodes, the communicator's own plan; none elsewhere)
        keep_comm_plan(s, plan_key, "broadcast", vars_, sids, None, proc.device.comm_for(proc, cpu),
                       _step_of(proc, spec), receive=lambda sid, value: receive_into(proc, sid, proc.shareds[sid], value))


@nodes.stepped("scatter")
@state.serialized
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
        send(s, spec)
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
    with command_lock:  # (state.serialized, with the kept plan first: see plans.planned_gather)
        joined = planned_gather(shared_vars, nd_up, nccl)
        if joined is not None:
            return _ret(joined, type(shared_vars) not in (list, tuple))
        return _gather(shared_vars, nd_up, nccl)


def _gather(shared_vars, nd_up, nccl):
    state.refuse_nested("gather")
    if nd_up not in (0, 1) or isinstance(nd_up, bool):
        raise ValueError(f"nd_up must be 0 (concatenate) or 1 (stack), got {nd_up!r}")
    cpu = not _check_nccl(nccl)
    s, vars_, sids, single = _resolve(shared_vars)
    joined = send(s, CollectiveSpec("gather", sids, nd_up=nd_up, cpu=cpu),
                   plan_key=("gather", resolve_key(shared_vars), nd_up, nccl))
    return _ret(joined, single)


@nodes.stepped("all_gather")
@state.serialized
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
    return _ret(send(s, CollectiveSpec("all_gather", sids, cpu=cpu)), single)


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
    with command_lock:  # (state.serialized, with the kept plan first: see plans.planned_reduce)
        got = planned_reduce(shared_vars, op, in_place, nccl)
        if got is None:
            return _reduce(shared_vars, op, in_place, nccl)
        if in_place:
            for v, g in zip(_as_list(shared_vars)[0], got):
                assign(v, g)
            return None
        return _ret(got, type(shared_vars) not in (list, tuple))


def _reduce(shared_vars, op, in_place, nccl):
    state.refuse_nested("reduce")
    name, cpu = parse_op(op)
    cpu = not _check_nccl(nccl) or cpu
    s, vars_, sids, single = _resolve(shared_vars)
    spec = CollectiveSpec("reduce", sids, op=name, in_place=bool(in_place), cpu=cpu)
    plan_key = ("reduce", resolve_key(shared_vars), (op, bool(in_place)), nccl)
    res = send(s, spec, plan_key=plan_key)
    proc = s.proc
    if plan_key[1] is not None and proc.size == 1 and proc.comm.among_nodes() is not None \
            and not proc.device.keeps_values_on_device:  # a node of one process across nodes
        keep_comm_plan(s, plan_key, "reduce", vars_, sids, name, proc.comm, _step_of(proc, spec))
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
    with command_lock:  # (state.serialized, with the kept plan first: see plans.planned)
        if planned("all_reduce", shared_vars, op, nccl):
            return None
        return _all_reduce(shared_vars, op, nccl)


def _all_reduce(shared_vars, op, nccl) -> None:
    state.refuse_nested("all_reduce")
    name, cpu = parse_op(op)
    cpu = not _check_nccl(nccl) or cpu
    s, vars_, sids, _ = _resolve(shared_vars)
    spec = CollectiveSpec("all_reduce", sids, op=name, cpu=cpu)
    plan_key = ("all_reduce", resolve_key(shared_vars), op, nccl)
    send(s, spec, plan_key=plan_key)
    proc = s.proc
    if plan_key[1] is None:
        return
    if proc.size == 1:  # a fork of one process: the communicator's own plan
        keep_comm_plan(s, plan_key, "all_reduce", vars_, sids, name, proc.device.comm_for(proc, cpu),
                       _step_of(proc, spec), spare=lambda sid, value: spare_home(proc, sid, value))
    elif proc.comm.among_nodes() is not None and not proc.device.keeps_values_on_device:
        # a node of several processes across nodes: the node master's direct plan
        keep_node_plan(s, plan_key, vars_, sids, name, proc.comm, _step_of(proc, spec))


def _step_of(proc, spec) -> tuple:
    """Across nodes, the step key and words of ``spec``'s step, as the full path numbers it."""
    wire = wire_of(spec)
    return nodes.step_key("collective", wire, proc), (nodes.step_words, proc, "collective", wire)


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
@state.serialized
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
        ValueError: a variable that no distributed function uses; a rank out of range; values that
            do not match the variables in number.
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
        send(s, spec)
    finally:
        _unstage(s, "set_value", len(arrays))


@nodes.stepped("get_value")
@state.serialized
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
    got = send(s, CollectiveSpec("get_value", sids, rank=rank))
    if len(got) != len(vars_) or any(g is None for g in got):  # across nodes, a node that has joined
        nodes.joined_rank(s.proc, rank, "get_value")
    return _ret(got, single)


@nodes.stepped("get_lengths")
@state.serialized
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
    shapes = send(s, CollectiveSpec("get_shapes", sids))
    return _ret([np.array([sh[0] for sh in per]) for per in shapes], single)


@nodes.stepped("get_shapes")
@state.serialized
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
    return _ret(send(s, CollectiveSpec("get_shapes", sids)), single)


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
    got = send(s, CollectiveSpec("placement", sids))
    return got[0] if single else got
