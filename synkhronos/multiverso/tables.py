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


def as_numpy(data, what: str) -> np.ndarray:
    """``data`` (numpy, PyTorch, JAX, lists, ranges) as a numpy array of numbers, no copy if possible."""
    if data is None:
        raise TypeError(f"{what}: data is None; expected an array of numbers")
    try:
        arr = np.asarray(data)
    except (TypeError, ValueError, RuntimeError) as err:
        detach = getattr(data, "detach", None)  # a PyTorch tensor that needs grad or lives on a GPU
        if detach is None:
            raise TypeError(f"{what}: cannot read {type(data).__name__} as an array of numbers "
                            f"({err})") from None
        arr = np.asarray(detach().cpu())
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{what}: data must hold real numbers, got an array of dtype {arr.dtype}")
    return arr


def _values(data, dtype, count: int, what: str, expect: str) -> np.ndarray:
    arr = as_numpy(data, what)
    if arr.size != count:
        raise ValueError(f"{what}: data has {arr.size} values (shape {arr.shape}) but {expect}")
    return np.ascontiguousarray(arr, dtype=dtype).reshape(-1)


def _row_ids(row_ids, num_row: int, what: str) -> np.ndarray:
    try:
        ids = np.asarray(row_ids)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what}: row_ids must be a list of ints, got {row_ids!r} ({err})") from None
    if ids.ndim != 1:
        raise ValueError(f"{what}: row_ids must be one-dimensional, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what}: row_ids must be ints, got dtype {ids.dtype} ({row_ids!r:.80})")
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
        """``out`` checked and viewed as ``shape``, or a new array."""
        if out is None:
            return np.empty(shape, dtype=self._dtype)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{what}: out must be a numpy array, got {type(out).__name__}")
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
            data: ``size`` numbers of any shape (numpy, PyTorch, JAX, a list);
                cast to the table's dtype (copied only when needed). The
                caller may reuse it as soon as ``add`` returns.
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

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        """The table's value, shape ``(size,)``.

        Args:
            out: an array of the table's dtype to copy into (shape ``(size,)``
                or any C-contiguous array of ``size`` values).

        Returns:
            A new array, or ``out``.

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError, ValueError: ``out`` of the wrong type, dtype or size.
            WorkerFailedError: another worker failed.
        """
        result = self._out(out, (self._size,), "ArrayTableHandler.get()")
        self._get(result.reshape(self._size, 1), None)
        return result if out is None else out


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
                           f"the table holds {self._num_row}x{self._num_col} = {self._size}")
            self._add(flat, None, sync)
            return
        ids = _row_ids(row_ids, self._num_row, what)
        flat = _values(data, self._dtype, len(ids) * self._num_col, what,
                       f"{len(ids)} row ids of {self._num_col} columns need {len(ids) * self._num_col}")
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

    def get(self, row_ids=None, out: np.ndarray | None = None) -> np.ndarray:
        """The whole table ``(num_row, num_col)``, or the rows ``row_ids`` in the order given.

        Args:
            row_ids: the rows to read (repeats allowed), or None for all.
            out: an array of the table's dtype to copy into.

        Returns:
            A new array, or ``out``.

        Raises:
            SynkError: called before ``init()`` or after ``shutdown()``.
            TypeError, ValueError: ``row_ids`` or ``out`` of the wrong type or size.
            IndexError: a row id out of range.
            WorkerFailedError: another worker failed.
        """
        what = "MatrixTableHandler.get()"
        if row_ids is None:
            result = self._out(out, (self._num_row, self._num_col), what)
            self._get(result, None)
        else:
            ids = _row_ids(row_ids, self._num_row, what)
            result = self._out(out, (len(ids), self._num_col), what)
            self._get(result, ids)
        return result if out is None else out
