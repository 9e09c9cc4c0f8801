"""``ArrayTableHandler`` and ``MatrixTableHandler``: Multiverso's tables, with checked inputs.

A handler validates what the user gives (sizes, row ids, dtypes, ``out``)
and leaves the storage to the store its world makes (shared memory on one
machine, MPI windows across machines): the same table code serves both.
"""

from __future__ import annotations

import math

import numpy as np

from . import api

__all__ = ["TableHandler", "ArrayTableHandler", "MatrixTableHandler"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _table_dtype(dtype, what: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in _DTYPES:
        raise TypeError(f"{what}: dtype must be float32 or float64, got {dt}")
    return dt


def _count(value, name: str, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what}: {name} must be at least {minimum}, got {value}")
    return int(value)


def is_tensor(value) -> bool:
    """True for a ``torch.Tensor`` or a subclass of it (recognised without importing PyTorch)."""
    return any(c.__name__ == "Tensor" and c.__module__.startswith("torch")
               for c in type(value).__mro__)


def _tensor_as_numpy(tensor, what: str) -> np.ndarray:
    """A PyTorch tensor's values on the CPU (sharing its memory when it is a plain CPU tensor)."""
    t = tensor.detach()
    if t.is_complex():
        raise TypeError(f"{what}: data must hold real numbers, got a tensor of dtype {t.dtype}")
    if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds it exactly
        t = t.float()
    return t.cpu().resolve_neg().numpy()


def as_numpy(data, what: str) -> np.ndarray:
    """``data`` (numpy, PyTorch, JAX, lists, ranges) as a numpy array of numbers, no copy if possible."""
    if data is None:
        raise TypeError(f"{what}: data is None; expected an array of numbers")
    if is_tensor(data):
        arr = _tensor_as_numpy(data, what)
    else:
        try:
            arr = np.asarray(data)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{what}: cannot read {type(data).__name__} as an array of numbers "
                            f"({err})") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{what}: data must hold real numbers, got an array of dtype {arr.dtype}")
    return arr


def _values(data, dtype, count: int, what: str, expect: str, rows: tuple | None = None) -> np.ndarray:
    """``data`` as a flat array of ``count`` values; with ``rows`` (the matrix shape it
    stands for) data of two or more dimensions must have that shape exactly (a transposed
    matrix has the right size too)."""
    arr = as_numpy(data, what)
    if arr.size != count:
        raise ValueError(f"{what}: data has {arr.size} values (shape {arr.shape}) but {expect}")
    if rows is not None and arr.ndim >= 2 and arr.shape != rows:
        raise ValueError(f"{what}: data has shape {arr.shape} but {expect} in shape {rows} "
                         "(or flat)")
    return np.ascontiguousarray(arr, dtype=dtype).reshape(-1)


def _tensor_view(tensor, dtype: np.dtype, what: str) -> np.ndarray:
    """A numpy view of a CPU tensor that ``get`` may fill in place (autograd does not see it,
    as with ``tensor.data``)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: out is a tensor on {tensor.device}; it must be on the CPU "
                         "(or use get(as_tensor=True).to(device))")
    if str(tensor.dtype) != f"torch.{dtype.name}":
        raise TypeError(f"{what}: out has dtype {tensor.dtype} but the table holds {dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: out is a non-contiguous tensor (shape {tuple(tensor.shape)}); "
                         "give a contiguous one")
    return tensor.detach().numpy()


def _torch_for(as_tensor, what: str):
    """The ``torch`` module when ``as_tensor`` asks for tensors, else None (checked before any get)."""
    if not isinstance(as_tensor, bool):
        raise TypeError(f"{what}: as_tensor must be True or False, got {as_tensor!r}")
    if not as_tensor:
        return None
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"{what}: as_tensor=True needs PyTorch: pip install "
                          "'synkhronos[torch]'") from err
    return torch


def _row_ids(row_ids, num_row: int, what: str) -> np.ndarray:
    try:
        ids = np.asarray(row_ids)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what}: row_ids must be a list of ints, got {row_ids!r} ({err})") from None
    if ids.ndim != 1:
        raise ValueError(f"{what}: row_ids must be one-dimensional, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    flags = not isinstance(row_ids, np.ndarray) and any(isinstance(i, (bool, np.bool_)) for i in row_ids)
    if ids.dtype.kind not in "iu" or flags:
        raise TypeError(f"{what}: row_ids must be ints, got {row_ids!r:.80} (dtype {ids.dtype}; "
                        "True and False are not row ids)")
    bad = ids[(ids < 0) | (ids >= num_row)]
    if bad.size:
        raise IndexError(f"{what}: row id {int(bad[0])} is out of range for a table of {num_row} "
                         f"rows (0 to {num_row - 1})")
    return ids.astype(np.int64, copy=False)


class TableHandler:
    """What every table shares: construction by every worker, add, get.

    Tables are made collectively: every worker constructs the same tables in
    the same order (a mismatch is an error on every worker). With
    ``init_value`` the table holds the master's value (the other workers'
    values are ignored), as in Multiverso.
    """

    _kind = "table"

    def _setup(self, num_row: int, num_col: int, init_value, dtype, what: str) -> None:
        state = api.current(what)
        self._dtype = _table_dtype(dtype, what)
        self._num_row, self._num_col = num_row, num_col
        self._size = num_row * num_col
        init = None
        if init_value is not None:
            init = _values(init_value, self._dtype, self._size, what,
                           f"the table holds {self._size} values")
            if state.world.rank != 0:
                init = None
        self._state = state
        self._gets = 0
        self._store = state.world.new_store(len(state.tables), num_row, num_col, self._dtype, init)
        state.tables.append(self)

    @property
    def dtype(self) -> np.dtype:
        """The element type of the table (float32 or float64)."""
        return self._dtype

    def _live(self, what: str):
        state = api.current(what)
        if self._store is None:
            raise api.SynkError(f"{what}: the table was freed by shutdown()")
        state.world.check(what)  # a failed worker shows in every add and get, not only in waits
        return self._store

    def _add(self, flat: np.ndarray, rows, sync: bool) -> None:
        store = self._live(f"{type(self).__name__}.add()")
        if self._state.sync:
            store.before_add(self._gets)
        data = flat.reshape(-1, self._num_col)
        store.add(data, rows)
        if sync:
            store.flush()

    def _get(self, out: np.ndarray, rows) -> None:
        store = self._live(f"{type(self).__name__}.get()")
        if self._state.sync:
            store.before_get(self._gets + 1)
        store.get(out, rows)
        if self._state.sync:
            store.after_get(self._gets + 1)
        self._gets += 1

    def _out(self, out, shape, what: str) -> np.ndarray:
        """``out`` checked and viewed as ``shape`` (a tensor through a numpy view), or a new array."""
        if out is None:
            return np.empty(shape, dtype=self._dtype)
        if is_tensor(out):
            out = _tensor_view(out, self._dtype, what)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{what}: out must be a numpy array or a torch.Tensor, got "
                            f"{type(out).__name__}")
        if out.dtype != self._dtype:
            raise TypeError(f"{what}: out has dtype {out.dtype} but the table holds {self._dtype}")
        if not out.flags.writeable:
            raise ValueError(f"{what}: out is read-only")
        if out.shape == tuple(shape):
            return out
        if out.size == math.prod(shape) and out.flags.c_contiguous:
            return out.reshape(shape)
        raise ValueError(f"{what}: out has shape {out.shape} but the result has shape "
                         f"{tuple(shape)} (a C-contiguous array of {math.prod(shape)} values also "
                         "works)")

    @staticmethod
    def _result(result: np.ndarray, out, torch):
        """What ``get`` returns: ``out`` when given (a tensor stays one), else the new array,
        as a tensor sharing its memory when ``torch`` is given."""
        if out is not None and (torch is None or is_tensor(out)):
            return out
        return result if torch is None else torch.from_numpy(result)

    def free(self) -> None:
        """Release this process's hold on the table's memory; ``shutdown()`` frees
        every table, and the table cannot be used afterwards."""
        if self._store is not None:
            self._store.close()
            self._store = None


class ArrayTableHandler(TableHandler):
    """A one-dimensional table of ``size`` values, summed over every worker's adds.

    Args:
        size: the number of values (1 and more).
        init_value: the initial value (``size`` values); only the master's is used.
        dtype: float32 (default, as Multiverso) or float64.

    Raises:
        SynkError: called before ``init()`` or after ``shutdown()``.
        TypeError: ``size`` is not an int, or a dtype is not supported.
        ValueError: ``size`` below 1, ``init_value`` of the wrong size, or the
            workers constructed different tables.
        WorkerFailedError: another worker failed meanwhile.
    """

    def __init__(self, size: int, init_value=None, dtype=np.float32):
        what = "ArrayTableHandler()"
        size = _count(size, "size", what)
        self._setup(size, 1, init_value, dtype, what)

    def add(self, data, sync: bool = False) -> None:
        """Add ``data`` to the table: the table becomes ``value + data``.

        Args:
            data: ``size`` numbers of any shape (numpy, a ``torch.Tensor`` on
                any device, JAX, a list); cast to the table's dtype (copied
                only when needed). The caller may reuse it as soon as ``add``
                returns.
            sync: wait until the add is applied everywhere (under MPI; on one
                machine every add is applied before it returns).

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError: ``data`` is not an array of real numbers.
            ValueError: ``data`` does not hold ``size`` values.
            WorkerFailedError: another worker failed.
        """
        what = "ArrayTableHandler.add()"
        self._add(_values(data, self._dtype, self._size, what,
                          f"the table holds {self._size}"), None, sync)

    def get(self, out=None, as_tensor: bool = False):
        """The table's value, shape ``(size,)``.

        Args:
            out: an array of the table's dtype to copy into (shape ``(size,)``
                or any C-contiguous array of ``size`` values): a numpy array,
                or a contiguous CPU ``torch.Tensor`` (filled in place, as
                through ``tensor.data``).
            as_tensor: return a ``torch.Tensor`` (on the CPU, sharing the
                result's memory) instead of a numpy array.

        Returns:
            A new numpy array (a tensor with ``as_tensor``), or ``out``.

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError, ValueError: ``out`` of the wrong type, dtype, size or device.
            ImportError: ``as_tensor=True`` without PyTorch.
            WorkerFailedError: another worker failed.
        """
        what = "ArrayTableHandler.get()"
        torch = _torch_for(as_tensor, what)
        result = self._out(out, (self._size,), what)
        self._get(result.reshape(self._size, 1), None)
        return self._result(result, out, torch)


class MatrixTableHandler(TableHandler):
    """A ``num_row`` x ``num_col`` table, added to and read whole or by rows.

    Args:
        num_row, num_col: the shape (1 and more each).
        init_value: the initial value (``num_row * num_col`` values, flat or
            2-D); only the master's is used.
        dtype: float32 (default) or float64.

    Raises:
        SynkError: called before ``init()`` or after ``shutdown()``.
        TypeError: a size is not an int, or a dtype is not supported.
        ValueError: a size below 1, ``init_value`` of the wrong size, or the
            workers constructed different tables.
        WorkerFailedError: another worker failed meanwhile.
    """

    def __init__(self, num_row: int, num_col: int, init_value=None, dtype=np.float32):
        what = "MatrixTableHandler()"
        num_row = _count(num_row, "num_row", what)
        num_col = _count(num_col, "num_col", what)
        self._setup(num_row, num_col, init_value, dtype, what)

    def add(self, data, row_ids=None, sync: bool = False) -> None:
        """Add ``data`` to every row, or to the rows ``row_ids``.

        Args:
            data: ``num_row * num_col`` numbers (flat or 2-D) without
                ``row_ids``; ``len(row_ids) * num_col`` with them, row by row
                in the order of ``row_ids``.
            row_ids: the rows to add to. A row listed more than once receives
                every one of its rows of ``data`` (as ``numpy.add.at`` does).
            sync: wait until the add is applied everywhere.

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError: ``data`` or ``row_ids`` of the wrong type.
            ValueError: ``data`` of the wrong size.
            IndexError: a row id out of range.
            WorkerFailedError: another worker failed.
        """
        what = "MatrixTableHandler.add()"
        if row_ids is None:
            flat = _values(data, self._dtype, self._size, what,
                           f"the table holds {self._num_row}x{self._num_col} = {self._size}",
                           rows=(self._num_row, self._num_col))
            self._add(flat, None, sync)
            return
        ids = _row_ids(row_ids, self._num_row, what)
        flat = _values(data, self._dtype, len(ids) * self._num_col, what,
                       f"{len(ids)} row ids of {self._num_col} columns need {len(ids) * self._num_col}",
                       rows=(len(ids), self._num_col))
        rows = flat.reshape(len(ids), self._num_col)
        uniq, inverse = np.unique(ids, return_inverse=True)
        if len(uniq) != len(ids):
            summed = np.zeros((len(uniq), self._num_col), dtype=self._dtype)
            np.add.at(summed, inverse, rows)
            rows = summed
        elif len(ids) and np.any(ids[1:] < ids[:-1]):
            order = np.argsort(ids, kind="stable")
            rows = rows[order]
        self._add(rows, uniq, sync)

    def get(self, row_ids=None, out=None, as_tensor: bool = False):
        """The whole table ``(num_row, num_col)``, or the rows ``row_ids`` in the order given.

        Args:
            row_ids: the rows to read (repeats allowed), or None for all.
            out: an array of the table's dtype to copy into: a numpy array or
                a contiguous CPU ``torch.Tensor``.
            as_tensor: return a ``torch.Tensor`` (on the CPU, sharing the
                result's memory) instead of a numpy array.

        Returns:
            A new numpy array (a tensor with ``as_tensor``), or ``out``.

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError, ValueError: ``row_ids`` or ``out`` of the wrong type,
                size or device.
            IndexError: a row id out of range.
            ImportError: ``as_tensor=True`` without PyTorch.
            WorkerFailedError: another worker failed.
        """
        what = "MatrixTableHandler.get()"
        torch = _torch_for(as_tensor, what)
        if row_ids is None:
            result = self._out(out, (self._num_row, self._num_col), what)
            self._get(result, None)
        else:
            ids = _row_ids(row_ids, self._num_row, what)
            result = self._out(out, (len(ids), self._num_col), what)
            self._get(result, ids)
        return self._result(result, out, torch)
