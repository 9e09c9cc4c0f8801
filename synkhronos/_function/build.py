"""synk.function: building a data-parallel function and parsing its arguments."""

from __future__ import annotations

import re
import warnings

import numpy as np
from pytensor.graph.basic import Variable

from .. import _state as state
from .._protocol import across_nodes as nodes
from .._protocol.distribute import graph_digest
from ..collectives.ops import OUTPUT_OPS, check_op
from ..errors import user_stacklevel
from .master import Function
from .spec import FunctionSpec, LocalFunction

__all__ = ["function"]


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
    s = state.running_session()
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
    fid = state.next_function_id()
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
