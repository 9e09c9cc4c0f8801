"""A log-likelihood graph split by rows: each per-row leaf made a process's rows, and a proof
from the graph's structure that the split terms add up to the whole (used by synkhronos.pymc).

One pass over the graph, in topological order, knows for each variable its *row axis* (the
axis that runs over the data's rows, or none) and whether its value depends on the *number*
of rows. An op is known to keep rows apart when its rule below says so: elementwise ops,
axis moves, reductions and scans along other axes, products whose rows stay an output axis,
indexing by per-row indices, and the broadcast PyMC wraps around a term. Anything else that
touches the rows (a reduction or a slice along them, a term that depends on the number of
rows, an op with no rule) is a :class:`Coupling`, whatever the data's values are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Constant, Variable, equal_computations
from pytensor.graph.replace import graph_replace
from pytensor.tensor.basic import Alloc, ARange, Join, Split
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.extra_ops import CumOp
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Reshape, Shape, Shape_i, SpecifyShape
from pytensor.tensor.special import LogSoftmax, Softmax
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor

# (the type: ignores: mypy reads one PyTensor, the name is in some releases only)
try:
    from pytensor.tensor.subtensor import AdvancedSubtensor1  # type: ignore[attr-defined, unused-ignore]
except ImportError:  # PyTensor 3: AdvancedSubtensor only
    AdvancedSubtensor1 = AdvancedSubtensor  # type: ignore[misc, assignment, unused-ignore]

try:
    from pytensor.graph.traversal import graph_inputs, io_toposort
except ImportError:  # pragma: no cover - PyTensor 2
    from pytensor.graph.basic import graph_inputs, io_toposort  # type: ignore[no-redef, unused-ignore]  # (the other PyTensor's)

__all__ = ["Coupling", "batched_op_of_rows", "hoist_data_only", "masks_as_positions", "split_rows"]


class Coupling(ValueError):
    """The graph combines different rows (or depends on their number): the sum of a split's
    terms would not be the whole's."""


@dataclasses.dataclass(frozen=True)
class _Rows:
    axis: int | None = None      # the axis along the rows, or None
    count: bool = False          # the value depends on the number of rows, or on their positions as values
    index: bool = False          # the value is the rows' own positions (an arange over them)
    coupled: str | None = None   # why the value mixes rows, if it does
    shape_of: int | None = None  # the value is a shape vector whose entry shape_of is the count
    selected: Any = None         # the rows are those a per-row boolean mask kept (the mask), or all


_NONE = _Rows()


def split_rows(outputs, replace, n_rows, guard=None, strict=True, axes=None, masked=None) -> list:
    """``outputs`` (one elementwise term per output) with ``replace`` made (each per-row leaf ->
    a variable of any number of rows: its row axis is ``axes[leaf]``, 0 where not given). Each
    output comes back with its rows along axis 0 (transposed where they end up elsewhere: its
    sum is the same).

    Every node that reads rows is built anew (no static shape of the whole survives);
    shape assertions are dropped; a shape entry of ``n_rows`` at a row axis (PyMC's
    broadcast of a term to its dims) becomes the rows' count. ``guard(node)`` may return
    a replacement for a parameter check (its conditions are not a coupling: a failed
    check makes the whole -inf, and so the share that holds the failing row).

    ``masked``, a list, gets for each output whether its rows are those a per-row boolean mask
    kept (fewer than the data's rows: each process's share has fewer rows than its data).

    Raises:
        Coupling: an output's rows are not kept apart (the message says where); not
            raised where ``strict`` is false (the caller vouches for the graph)."""
    axes = axes or {}
    first = next(iter(replace))
    count = replace[first].shape[axes.get(first, 0)]
    walk = _Walk(dict(replace), {k: _Rows(axis=axes.get(k, 0)) for k in replace}, count, n_rows, guard)
    for node in io_toposort(list(graph_inputs(outputs)), outputs):
        walk.visit(node)
    done = []
    for out in outputs:
        rows = walk.rows.get(out, _NONE)
        counted = "its value depends on the number of rows, or on their positions (an arange over them as a value)"
        why = rows.coupled or (counted if rows.count else None) or \
            ("it does not read the per-row data (every process would add the whole)" if rows.axis is None
             else None)
        if why and strict:
            raise Coupling(why)
        new = walk.memo.get(out, out)
        if masked is not None:
            masked.append(rows.selected is not None or any(r.selected is not None for r in walk.rows.values()))
        if not why and rows.axis != 0:  # rows first: the terms' sum is the same
            new = new.dimshuffle([rows.axis] + [a for a in range(new.type.ndim) if a != rows.axis])
        done.append(new)
    return done


class _Walk:
    def __init__(self, memo, rows, count, n_rows, guard):
        self.memo, self.rows, self.count, self.n_rows, self.guard = memo, rows, count, n_rows, guard

    def visit(self, node) -> None:
        ins = [self.rows.get(i, _NONE) for i in node.inputs]
        new_inputs = [self.memo.get(i, i) for i in node.inputs]
        op = node.op
        if isinstance(op, SpecifyShape):
            self._set(node.outputs[0], new_inputs[0], ins[0])
            return
        if self.guard is not None and (guarded := self.guard(node, new_inputs)) is not None:
            self._set(node.outputs[0], guarded, ins[0])
            return
        coupled = next((r.coupled for r in ins if r.coupled), None)
        if coupled:  # kept, not raised: only a parameter check's conditions may read it
            out = [_Rows(coupled=coupled)] * len(node.outputs)
        elif not any(r.axis is not None or r.count or r.index for r in ins) and not isinstance(op, Alloc):
            if all(a is b for a, b in zip(new_inputs, node.inputs)):
                return
            out = [_NONE] * len(node.outputs)
        else:
            try:
                if isinstance(op, Alloc):
                    new_inputs, out = self._alloc(node, ins, new_inputs)
                else:
                    out = _rule(node, ins)
            except Coupling as err:
                out = [_Rows(coupled=str(err))] * len(node.outputs)
        if all(a is b for a, b in zip(new_inputs, node.inputs)):
            new_outputs = node.outputs
        elif isinstance(op, OpFromGraph):  # a symbolic op builds its inner graph for the new types
            new_outputs = op(*new_inputs, return_list=True)
        else:
            new_outputs = op.make_node(*new_inputs).outputs
        for old, new, rows in zip(node.outputs, new_outputs, out):
            self._set(old, new, rows)

    def _set(self, old, new, rows) -> None:
        self.memo[old] = new
        if rows != _NONE:
            self.rows[old] = rows

    def _alloc(self, node, ins, new_inputs):
        """PyMC broadcasts each term to its variable's shape: the entry of ``n_rows`` along the
        rows becomes the rows' count (the dims of the observed variable follow the share)."""
        value, shape = ins[0], ins[1:]
        ndim = len(shape)
        axis = None if value.axis is None else value.axis + ndim - node.inputs[0].type.ndim
        if axis is None:
            counted = [i for i, r in enumerate(shape) if r.count]
            axis = counted[0] if counted else None
        for i, r in enumerate(shape):
            if i == axis:
                continue
            if r.count or r.axis is not None:
                raise Coupling(f"{node.op} broadcasts along axis {i} by the number of rows")
        if axis is None:
            return new_inputs, [_NONE]
        selected = value.selected
        if not shape[axis].count:
            if selected is not None or not _equals(node.inputs[1 + axis], self.n_rows):
                raise Coupling(f"{node.op} broadcasts its rows to {node.inputs[1 + axis]}, not to the rows")
            new_inputs = list(new_inputs)
            new_inputs[1 + axis] = self.count.astype(node.inputs[1 + axis].dtype)
        elif value.axis is None:
            selected = shape[axis].selected
        elif not _same_mask(selected, shape[axis].selected):
            raise Coupling(f"{node.op} broadcasts rows kept by a boolean mask to another number of rows")
        return new_inputs, [_Rows(axis=axis, count=value.count, selected=selected)]


def _equals(var, n) -> bool:
    """``var`` is a number known without any input (a constant or a shared value) equal to ``n``."""
    if any(not isinstance(v, Constant) and not hasattr(v, "get_value") for v in graph_inputs([var])):
        return False
    try:  # Python's linker, no rewrites: a few shape entries, evaluated at once
        value = var.data if isinstance(var, Constant) else \
            pytensor.function([], var, mode=Mode(linker="py", optimizer=None))()  # type: ignore[arg-type]  # None: no rewrites
    except Exception:  # noqa: BLE001 - not a number known now
        return False
    return np.ndim(value) == 0 and value == n


def _rule(node, ins) -> list:
    """The rows of ``node``'s outputs from its inputs' rows, or :class:`Coupling`."""
    op = node.op
    if any(r.selected is not None for r in ins) and not isinstance(op, _SELECTION_SAFE):
        raise Coupling(f"{op} reads rows kept by a boolean mask and is not known to keep them apart")
    for kind, rule in _RULES:
        if isinstance(op, kind):
            return rule(node, ins)
    touched = [i for i, r in enumerate(ins) if r.axis is not None or r.count]
    raise Coupling(f"{op} reads the rows (input {touched[0]}) and is not known to keep them apart")


def _counted(ins) -> bool:
    """Whether a value made of ``ins`` depends on which rows a process holds: on their number,
    or on their positions used as a value (an arange over the rows restarts at 0 in each
    process's share; only as an index, or copied, are they the rows' own)."""
    return any(r.count or r.index for r in ins)


def _elemwise(node, ins) -> list:
    axes = {r.axis for r in ins if r.axis is not None}
    if len(axes) > 1:
        raise Coupling(f"{node.op} combines rows along different axes {sorted(axes)}")
    axis = axes.pop() if axes else None
    # (a count of the rows a mask keeps stays one: it broadcasts only rows that mask keeps)
    selected = _one_selection(node, [r for r in ins if r.axis is not None or (axis is None and r.count)])
    if axis is not None:
        out_ndim = node.outputs[0].type.ndim
        for v, r in zip(node.inputs, ins):
            at = axis - (out_ndim - v.type.ndim)
            if r.axis is None and at >= 0 and not v.type.broadcastable[at]:
                # a value along the rows that is not split with them: all rows' worth of it in every
                # share (an error where the shares' row counts differ from it; a silent broadcast
                # where a share has one row and the backend broadcasts at run time)
                raise Coupling(f"{node.op} combines the rows with a value along the row axis that is not "
                               "per-row data (not split with the rows; such as covariates of all the rows "
                               "against observed data selected from them in NumPy)")
    index = axis is not None and all(r.index or r.axis is None for r in ins) and _is_index_copy(node)
    return [_Rows(axis=axis, count=_counted(ins) and not index, index=index, selected=selected)] * len(node.outputs)


def _one_selection(node, ins):
    """The boolean mask that kept the rows of every one of ``ins`` (None: all rows), or
    :class:`Coupling` where they differ: their rows would not be the same rows."""
    masks = [r.selected for r in ins]
    first = masks[0] if masks else None
    for m in masks[1:]:
        if not _same_mask(m, first):
            raise Coupling(f"{node.op} combines rows kept by different boolean masks (or by one and not the other)")
    return first


def _same_mask(a, b) -> bool:
    """Both all rows, or the same computation of one mask."""
    return a is b or (a is not None and b is not None and equal_computations([a], [b]))


def _is_index_copy(node) -> bool:
    """A cast of an arange over the rows stays the rows' positions."""
    scalar = getattr(node.op, "scalar_op", None)
    return type(scalar).__name__ in ("Cast", "Identity") and len(node.inputs) == 1


def _dimshuffle(node, ins) -> list:
    r = ins[0]
    if r.axis is None:
        return [r]
    order = list(node.op.new_order)
    if r.axis not in order:
        raise Coupling(f"{node.op} drops the row axis")
    return [dataclasses.replace(r, axis=order.index(r.axis))]


def _reduce(node, ins) -> list:
    r = ins[0]
    axis = node.op.axis
    axes = range(node.inputs[0].type.ndim) if axis is None else (axis if isinstance(axis, (tuple, list)) else (axis,))
    axes = [a % max(node.inputs[0].type.ndim, 1) for a in axes]
    if r.axis is not None and r.axis in axes:
        if _counts_a_mask(node, r):  # the number of rows a per-row boolean mask keeps
            return [_Rows(count=True, selected=node.inputs[0])]
        raise Coupling(f"{node.op} reduces over the rows")
    axis = None if r.axis is None else r.axis - sum(a < r.axis for a in axes)
    return [_Rows(axis=axis, count=_counted(ins[:1]), selected=r.selected)] * len(node.outputs)


def _counts_a_mask(node, r) -> bool:
    """``node`` sums a per-row boolean vector: the number of the rows it keeps (PyMC broadcasts
    a term of ``y[mask]`` to that shape), a count of those rows only."""
    return type(getattr(node.op, "scalar_op", None)).__name__ == "Add" and node.inputs[0].type.ndim == 1 \
        and node.inputs[0].type.dtype == "bool" and r.axis == 0 and r.selected is None and not _counted([r])


def _along_axis(node, ins) -> list:
    """Softmax, log-softmax and cumulative ops along one axis (or a few): not the rows'."""
    r = ins[0]
    axis, ndim = node.op.axis, max(node.inputs[0].type.ndim, 1)
    axes = None if axis is None else {a % ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,))}
    if r.axis is not None and (axes is None or r.axis in axes):
        raise Coupling(f"{node.op} runs along the rows")
    return [dataclasses.replace(r, count=_counted(ins[:1]), index=False)] * len(node.outputs)


def _op_axis(node, position):
    """A join's or a split's axis: an Op property (PyTensor 3) or a constant input (PyTensor 2)."""
    axis = getattr(node.op, "axis", None)
    if isinstance(axis, (int, np.integer)):
        return int(axis), list(node.inputs)
    var = node.inputs[position]
    rest = [v for i, v in enumerate(node.inputs) if i != position]
    return (int(var.data) if isinstance(var, Constant) else None), rest


def _shape(node, ins) -> list:
    """A shape: its row axis's entry is the count of the rows (of those a mask keeps, where one
    did: the count broadcasts, and counts, only rows that mask keeps)."""
    r = ins[0]
    if isinstance(node.op, Shape_i):
        at = node.op.i == r.axis
        return [_Rows(count=r.count or at, selected=r.selected if at else None)]
    return [_Rows(count=r.count or r.axis is not None, shape_of=None if r.count else r.axis, selected=r.selected)]


def _arange(node, ins) -> list:
    if _counted(ins[:1]) or _counted(ins[2:]) or not ins[1].count:
        raise Coupling(f"{node.op} of the rows' count does not run over the rows")
    return [_Rows(axis=0, index=True, selected=ins[1].selected)]  # (the positions of the rows a mask keeps)


def _join(node, ins) -> list:
    axis, rest = _op_axis(node, 0)
    parts = ins if len(rest) == len(ins) else ins[1:]
    axes = {r.axis for r in parts if r.axis is not None}
    if len(axes) > 1 or (axes and (axis is None or axis % node.outputs[0].type.ndim in axes)):
        raise Coupling(f"{node.op} joins along the rows")
    selected = _one_selection(node, [r for r in parts if r.axis is not None or (not axes and r.count)])
    return [_Rows(axis=axes.pop() if axes else None, count=_counted(parts), selected=selected)]


def _split(node, ins) -> list:
    r = ins[0]
    axis, _ = _op_axis(node, 1)
    if r.axis is not None and (axis is None or axis % node.inputs[0].type.ndim == r.axis):
        raise Coupling(f"{node.op} splits along the rows")
    # (sizes of the number of rows: each piece's value depends on it)
    return [dataclasses.replace(r, count=_counted(ins), index=False)] * len(node.outputs)


def _subtensor(node, ins) -> list:
    r = ins[0]
    if r.shape_of is not None and _counted(ins[:1]) and not _counted(ins[1:]):
        return [_shape_entry(node, r.shape_of, r.selected)]
    if _counted(ins[1:]) or any(x.axis is not None for x in ins[1:]):
        raise Coupling(f"{node.op} slices by the number of rows")
    if r.axis is None:
        return [r]
    idx = list(node.op.idx_list)
    if r.axis < len(idx) and idx[r.axis] != slice(None, None, None):
        raise Coupling(f"{node.op} indexes along the rows")
    dropped = sum(1 for i in idx[:r.axis] if not isinstance(i, slice))
    return [dataclasses.replace(r, axis=r.axis - dropped, count=_counted(ins[:1]), index=False)]


def _advanced(node, ins) -> list:
    """``x[i, j, ...]`` with index arrays (NumPy's advanced indexing: the index arrays broadcast
    to one block of axes, in place of their own where they are adjacent, first where a slice
    parts them). The rows of the output are

    * those of per-row index arrays (a group index ``a[g]``, ``tab[:, g]``, ``tab[0, g]``), where
      ``x`` has no rows and every other index array is one value along them;
    * ``x``'s rows, where a full slice takes them and no index array reads rows;
    * ``x``'s rows taken at their own positions (an arange over the rows, ``Categorical``), with
      per-row index arrays or single values at the other axes;
    * ``x``'s rows that a per-row boolean mask along them keeps (the only index array), marked
      with the mask: only values of rows kept by the same mask combine with them."""
    x = ins[0]
    entries, used = _index_entries(node)
    if any(r.count for r in ins[1:]):
        raise Coupling(f"{node.op} indexes by the number of rows")
    if any(ins[k].axis is not None for k in range(1, len(node.inputs)) if k not in used):
        raise Coupling(f"{node.op} slices by the rows' values")
    adv = [k for k, e in enumerate(entries) if e[0] == "tensor"]
    arrays = [node.inputs[entries[k][1]] for k in adv]
    if any(v.type.dtype == "bool" and v.type.ndim != 1 for v in arrays):
        raise Coupling(f"{node.op} indexes by a boolean mask of more than one axis")
    if any(v.type.dtype == "bool" for v in arrays) and len(arrays) > 1:
        raise Coupling(f"{node.op} indexes by a boolean mask with other index arrays")
    block = max(1 if v.type.dtype == "bool" else v.type.ndim for v in arrays)
    adjacent = adv == list(range(adv[0], adv[-1] + 1))
    start = adv[0] if adjacent else 0

    def out_axis(dim):  # the output axis of x's axis ``dim``, taken by a full slice
        if adjacent:
            return dim if dim < adv[0] else dim - len(adv) + block
        return block + dim - sum(a < dim for a in adv)

    row_arrays = [k for k in adv if ins[entries[k][1]].axis is not None]
    if x.axis is not None:
        entry = entries[x.axis] if x.axis < len(entries) else ("slice", None, True)
        if entry[0] == "slice":
            if not entry[2]:
                raise Coupling(f"{node.op} slices along the rows")
            if row_arrays:
                raise Coupling(f"{node.op} indexes the rows by per-row index arrays at another axis")
            return [_Rows(axis=out_axis(x.axis), count=_counted([x]), selected=x.selected)]
        mask = node.inputs[entry[1]]
        r = ins[entry[1]]
        if mask.type.dtype == "bool":
            if r.axis != 0 or r.index or x.selected is not None or r.selected is not None:
                raise Coupling(f"{node.op} indexes along the rows by a boolean mask that is not per-row data")
            return [_Rows(axis=start, count=_counted([x]), selected=node.inputs[entry[1]])]
        if not r.index:
            raise Coupling(f"{node.op} indexes along the rows by an index that is neither per-row data nor the "
                           "rows' own positions (a row read at another row's position, which another process "
                           "may hold; for covariates of all the rows taken at a NumPy index of the observed "
                           "rows, (X @ b)[idx] with observed=y[idx], select them in NumPy: X[idx] @ b)")
    elif any(ins[entries[k][1]].axis is not None and node.inputs[entries[k][1]].type.dtype == "bool" for k in adv):
        raise Coupling(f"{node.op} indexes by a per-row boolean mask something that has no rows")
    p = _rows_in_block(node, entries, adv, ins, block)
    if p is None:
        return [_Rows(axis=None, count=_counted([x]))]
    selected = _one_selection(node, [ins[entries[k][1]] for k in row_arrays] +
                              ([x] if x.axis is not None else []))
    return [_Rows(axis=start + p, count=_counted([x]), selected=selected)]


def _rows_in_block(node, entries, adv, ins, block):
    """The axis of the index arrays' broadcast block along which the per-row index arrays run
    (None: no index array reads rows), or :class:`Coupling`: they run along different axes,
    or an index array that is not per-row has more than one value along them."""
    where = set()
    for k in adv:
        v, r = node.inputs[entries[k][1]], ins[entries[k][1]]
        if r.axis is not None:
            if r.index and ins[0].axis is None:
                raise Coupling(f"{node.op} indexes by the rows' positions something that has no rows")
            where.add(r.axis + block - v.type.ndim)
    if not where:
        return None
    if len(where) > 1:
        raise Coupling(f"{node.op} indexes by rows along different axes")
    p = where.pop()
    for k in adv:
        v, r = node.inputs[entries[k][1]], ins[entries[k][1]]
        at = p - (block - v.type.ndim)
        if r.axis is None and at >= 0 and not v.type.broadcastable[at]:
            raise Coupling(f"{node.op} indexes by per-row index arrays and by an index array along the rows "
                           "that is not per-row data")
    return p


def _index_entries(node) -> tuple[list, set]:
    """``x[...]``'s index, one entry per axis of ``x`` it names: ``("slice", None, full)`` or
    ``("tensor", position in node.inputs, None)``; and the positions of the index arrays.
    PyTensor 3 keeps slices in the op (``idx_list``, its entries positions in the inputs after
    ``x``), PyTensor 2 as inputs of a slice type."""
    if isinstance(node.op, AdvancedSubtensor1) and AdvancedSubtensor1 is not AdvancedSubtensor:
        return [("tensor", 1, None)], {1}
    entries: list[tuple[str, Any, Any]] = []
    used: set[int] = set()
    idx_list = getattr(node.op, "idx_list", None)
    if idx_list is not None:  # PyTensor 3
        for e in idx_list:
            if isinstance(e, slice):
                entries.append(("slice", None, e == slice(None, None, None)))
            elif isinstance(e, (int, np.integer)):
                entries.append(("tensor", 1 + int(e), None))
                used.add(1 + int(e))
            else:
                raise Coupling(f"{node.op}: an index of a kind not known ({e!r})")
        return entries, used
    for k, v in enumerate(node.inputs[1:], start=1):
        if isinstance(v.type, pt.TensorType):
            entries.append(("tensor", k, None))
            used.add(k)
        elif type(v.type).__name__ == "SliceType":
            entries.append(("slice", None, isinstance(v, Constant) and v.data == slice(None, None, None)))
        else:
            raise Coupling(f"{node.op}: an index of a kind not known ({v.type})")
    return entries, used


def _shape_entry(node, axis, selected=None) -> _Rows:
    """An entry of a shape vector: the count only where it is the row axis's entry."""
    idx = list(node.op.idx_list)
    length = node.inputs[0].type.shape[0]
    if len(idx) == 1 and not isinstance(idx[0], slice) and isinstance(node.inputs[1], Constant) \
            and length is not None:
        at = int(node.inputs[1].data) % length == axis
        return _Rows(count=at, selected=selected if at else None)
    return _Rows(count=True, selected=selected)


def _dot(node, ins) -> list:
    x, y = ins
    if _counted(ins):
        raise Coupling(f"{node.op} of the number of rows (or of their positions)")
    xn, yn = node.inputs[0].type.ndim, node.inputs[1].type.ndim
    if x.axis is not None and (xn < 2 or x.axis != 0):
        raise Coupling(f"{node.op} sums over the rows")
    if y.axis is not None and (yn < 2 or y.axis != 1):
        raise Coupling(f"{node.op} sums over the rows")
    if x.axis is not None and y.axis is not None:
        raise Coupling(f"{node.op} of rows by rows")
    axis = 0 if x.axis is not None else (node.outputs[0].type.ndim - 1 if y.axis is not None else None)
    return [_Rows(axis=axis, selected=(x if x.axis is not None else y).selected)]


def _blockwise(node, ins) -> list:
    """Batched core ops: batch axes as elementwise (every other input one value along a batch
    axis of rows); a row axis among the core axes stays rows when the output names the same
    core dimension (a matrix product's rows). Rows kept by a boolean mask stay those rows."""
    sig_in, sig_out = node.op.inputs_sig, node.op.outputs_sig
    n_batch = node.outputs[0].type.ndim - len(sig_out[0])
    axes = set()
    for v, r, core in zip(node.inputs, ins, sig_in):
        if _counted([r]):
            raise Coupling(f"{node.op} of the number of rows (or of their positions)")
        if r.axis is None:
            continue
        batch = v.type.ndim - len(core)
        axes.add(("batch", r.axis + n_batch - batch) if r.axis < batch else ("core", core[r.axis - batch]))
    if len(axes) > 1:
        raise Coupling(f"{node.op} combines rows along different axes")
    if not axes:
        return [_NONE] * len(node.outputs)
    kind, where = axes.pop()
    selected = _one_selection(node, [r for r in ins if r.axis is not None])
    if kind == "batch":
        for v, r, core in zip(node.inputs, ins, sig_in):
            at = where - (n_batch - (v.type.ndim - len(core)))
            if r.axis is None and at >= 0 and not v.type.broadcastable[at]:
                # (as an elementwise op's: a value of every row's length in each share)
                raise Coupling(f"{node.op} combines the rows with a value along the row axis that is not "
                               "per-row data (not split with the rows)")
    out = []
    for v, core in zip(node.outputs, sig_out):
        batch = v.type.ndim - len(core)
        if kind == "batch":
            out.append(_Rows(axis=where + batch - n_batch, selected=selected))
        elif where in core:
            out.append(_Rows(axis=batch + core.index(where), selected=selected))
        else:
            raise Coupling(f"{node.op} sums over the rows (core dimension {where!r})")
    return out


def _reshape(node, ins) -> list:
    r, shape = ins
    if r.axis is None:
        if shape.count:
            raise Coupling(f"{node.op} to a shape of the number of rows")
        return [r]
    if r.axis != 0 or not (_first_entry_is_count(node.inputs[1]) or _keeps_first_axis(node)):
        raise Coupling(f"{node.op} reshapes the rows")
    if (r.selected is not None or shape.selected is not None) and not _keeps_first_axis(node):
        # (rows a mask keeps: reshaped by a constant (-1, *rest) only, one row to one row)
        raise Coupling(f"{node.op} reshapes rows kept by a boolean mask to a shape not known to keep them")
    keeps = r.index and node.inputs[0].type.ndim == 1  # (a vector of positions stays one)
    return [_Rows(axis=0, count=r.count or (r.index and not keeps), index=keeps, selected=r.selected)]


def _keeps_first_axis(node) -> bool:
    """A constant shape ``(-1, *rest)`` where ``rest`` holds exactly the input's other axes."""
    shape, x = node.inputs[1], node.inputs[0]
    if not isinstance(shape, Constant) or None in x.type.shape[1:]:
        return False
    entries = [int(e) for e in np.ravel(shape.data)]
    return bool(entries) and entries[0] == -1 and -1 not in entries[1:] \
        and int(np.prod(entries[1:])) == int(np.prod(x.type.shape[1:]))


def _first_entry_is_count(shape) -> bool:
    """``shape``'s first entry is the rows' count (PyTensor builds it as a vector of the
    input's own shape entries)."""
    owner = shape.owner
    if owner is None or type(owner.op).__name__ != "MakeVector":
        return False
    first = owner.inputs[0]
    while first.owner is not None and type(first.owner.op).__name__ in ("ScalarFromTensor", "TensorFromScalar",
                                                                         "Elemwise") \
            and len(first.owner.inputs) == 1:
        first = first.owner.inputs[0]
    return first.owner is not None and isinstance(first.owner.op, Shape_i) and first.owner.op.i == 0


def _passthrough(node, ins) -> list:
    return [_Rows(axis=ins[0].axis, count=_counted(ins), selected=ins[0].selected)] * len(node.outputs)


def _values(node, ins) -> list:
    """Shape arithmetic (vectors of shape entries, scalars from tensors): the rows' count flows."""
    if any(r.axis is not None for r in ins):
        raise Coupling(f"{node.op} reads the rows")
    counted = [i for i, r in enumerate(ins) if _counted([r])]
    if type(node.op).__name__ == "MakeVector" and len(counted) == 1:
        # a shape built of entries (PyMC 5 broadcasts a term to its value's shape so): the
        # count at one entry only, as Shape's (the row axis of data stored transposed is not 0)
        return [_Rows(count=True, shape_of=counted[0], selected=ins[counted[0]].selected)]
    selected = ins[counted[0]].selected if len(counted) == 1 else None
    return [_Rows(count=_counted(ins), selected=selected)] * len(node.outputs)


class _NamedOps:
    def __init__(self, *names):
        self.names = names

    def __instancecheck__(self, op) -> bool:
        return type(op).__name__ in self.names


#: (op classes, or a _NamedOps: isinstance's second argument) -> the op's rule
_RULES: tuple[tuple[Any, Callable[..., list]], ...] = (
    (Elemwise, _elemwise),
    (DimShuffle, _dimshuffle),
    ((CAReduce, _NamedOps("LogSumExp")), _reduce),
    ((Softmax, LogSoftmax, CumOp), _along_axis),
    ((Shape, Shape_i), _shape),
    (ARange, _arange),
    (Join, _join),
    (Split, _split),
    (Subtensor, _subtensor),
    ((AdvancedSubtensor, AdvancedSubtensor1), _advanced),
    (Dot, _dot),
    (Blockwise, _blockwise),
    (Reshape, _reshape),
    (_NamedOps("MakeVector", "ScalarFromTensor", "TensorFromScalar"), _values),
    (_NamedOps("DeepCopyOp", "OutputGuard", "ViewOp"), _passthrough),
)

#: Ops whose rule follows rows kept by a boolean mask (keeps them apart, combines them only with
#: rows kept by the same mask); any other op that reads them is a coupling.
_SELECTION_SAFE: tuple[Any, ...] = (Elemwise, DimShuffle, CAReduce, _NamedOps("LogSumExp"), Softmax, LogSoftmax, CumOp,
                                    Subtensor, AdvancedSubtensor, AdvancedSubtensor1, Shape, Shape_i, ARange, Join,
                                    Split, Dot, Blockwise, Reshape, _NamedOps("DeepCopyOp", "OutputGuard", "ViewOp"),
                                    _NamedOps("MakeVector", "ScalarFromTensor", "TensorFromScalar"))


def masks_as_positions(outputs) -> list | None:
    """``outputs`` with each 1-d boolean constant (a NumPy mask) that indexes something replaced
    by the positions it keeps, a constant of integers: ``x[mask]`` is ``x[np.flatnonzero(mask)]``,
    the same values and gradient. None: no such mask.

    Observed data selected in NumPy (``observed=t[~cens]``) against covariates of all the rows
    selected in the model (``lam[~cens]``) then split: the positions are per-row data of the
    observed data's rows, ``lam`` a value without rows that each share takes at its positions
    (a group index, :func:`split_rows`'s rule), computed whole in every process."""
    memo: dict = {}
    for node in io_toposort(list(graph_inputs(outputs)), outputs):
        ins = [memo.get(i, i) for i in node.inputs]
        if isinstance(node.op, (AdvancedSubtensor, AdvancedSubtensor1)):
            ins[1:] = [pt.constant(np.flatnonzero(v.data), name=f"positions kept by {v.name or 'a mask'}")
                       if isinstance(v, Constant) and getattr(v.type, "dtype", None) == "bool" and v.type.ndim == 1
                       else v for v in ins[1:]]
        if all(a is b for a, b in zip(ins, node.inputs)):
            continue
        new = node.op(*ins, return_list=True) if isinstance(node.op, OpFromGraph) else node.op.make_node(*ins).outputs
        memo.update(zip(node.outputs, new))
    return [memo.get(o, o) for o in outputs] if memo else None


def batched_op_of_rows(outputs, row_inputs):
    """The first batched op (a Blockwise with batch axes) of ``outputs`` that reads the per-row
    ``row_inputs``, or None. PyTensor's Python implementation fails on a batch of no rows
    (NumPy's ``vectorize`` of zero size), which a share holds where a mask keeps none of its
    rows, or where the data have one row."""
    reading = set(row_inputs)
    for node in io_toposort(list(graph_inputs(outputs)), outputs):
        if any(i in reading for i in node.inputs):
            reading.update(node.outputs)
            if isinstance(node.op, Blockwise) and node.outputs[0].type.ndim > len(node.op.outputs_sig[0]):
                return node.op
    return None


#: Scalar ops cheaper than reading one more number per row: a part of the graph that reads only
#: per-row data is computed once, before the calls, only where it holds some other op
#: (``gammaln(y + 1)``, ``log(y)``, ...).
_CHEAP = frozenset({"Add", "Sub", "Mul", "Neg", "Identity", "Cast", "EQ", "NEQ", "LT", "GT", "LE", "GE",
                    "AND", "OR", "XOR", "Invert", "Switch", "Abs", "Sqr", "Minimum", "Maximum", "Second"})


def hoist_data_only(outputs, row_inputs) -> tuple[list, list]:
    """``(outputs', [(input, graph), ...])``: each costly part of ``outputs`` that reads only
    the per-row ``row_inputs`` (and constants), keeping the rows along axis 0, made a new
    per-row input; ``graph`` computes it from ``row_inputs`` (once per change of the data
    instead of at every evaluation: XLA folds such parts for a peer that holds the data as
    constants)."""
    rows, consts = set(row_inputs), set()
    costly: dict[Variable, bool] = {}
    frontier = []
    for node in io_toposort(list(graph_inputs(outputs)), outputs):
        if all(isinstance(i, Constant) or i in consts for i in node.inputs):
            consts.update(node.outputs)
            continue
        if _row_wise(node, rows, consts):
            rows.update(node.outputs)
            own = type(getattr(node.op, "scalar_op", None)).__name__ not in _CHEAP and isinstance(node.op, Elemwise)
            cost = own or any(costly.get(i, False) for i in node.inputs)
            costly.update(dict.fromkeys(node.outputs, cost))
            continue
        frontier += [i for i in node.inputs if costly.get(i) and i not in frontier]
    frontier += [o for o in outputs if costly.get(o) and o not in frontier]
    if not frontier:
        return list(outputs), []
    new = [pt.TensorType(v.type.dtype, shape=(None,) + tuple(v.type.shape[1:]))(name=f"per-row {i}")
           for i, v in enumerate(frontier)]
    done = graph_replace(list(outputs), dict(zip(frontier, new)), strict=False)
    return done, list(zip(new, frontier))


def _row_wise(node, rows, consts) -> bool:
    """``node`` reads per-row data and constants only, and keeps the rows along axis 0."""
    if not any(i in rows for i in node.inputs) or \
            not all(i in rows or i in consts or isinstance(i, Constant) for i in node.inputs):
        return False
    if isinstance(node.op, Elemwise):
        return node.outputs[0].type.ndim >= 1
    if isinstance(node.op, DimShuffle):
        return bool(node.op.new_order) and node.op.new_order[0] == 0
    return False
