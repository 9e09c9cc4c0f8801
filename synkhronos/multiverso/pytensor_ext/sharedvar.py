"""``mv_shared``: a PyTensor shared variable whose value is kept in an array table."""

from __future__ import annotations

import numpy as np

from .. import api
from ..tables import ArrayTableHandler

__all__ = ["mv_shared", "sync_all_mv_shared_vars", "MVSharedVariable"]


def table_dtype(dtype) -> np.dtype:
    """float32 variables sync through a float32 table; every other dtype through float64."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float32 else np.dtype(np.float64)


def cast_back(values: np.ndarray, dtype) -> np.ndarray:
    """Table values as ``dtype`` (integers are rounded, never truncated)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        values = np.rint(values)
    elif dtype.kind == "b":
        values = values != 0
    return values.astype(dtype, copy=False)


class MVSharedVariable:
    """The table behind one shared variable, and what it last synced.

    Made by :func:`mv_shared` (collectively: every worker makes the same
    variables in the same order). The table starts with the master's value;
    every worker's variable is set to it.

    Args:
        svobj: a PyTensor shared variable (of numbers).

    Raises:
        TypeError: ``svobj`` is not a shared variable of numbers.
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
    """

    def __init__(self, svobj):
        from pytensor.compile.sharedvalue import SharedVariable

        if not isinstance(svobj, SharedVariable):
            raise TypeError(f"MVSharedVariable needs a PyTensor shared variable, got "
                            f"{type(svobj).__name__}")
        value = np.asarray(svobj.get_value(borrow=True))
        if value.dtype.kind not in "biuf":
            raise TypeError(f"mv_shared: the value of {svobj} has dtype {value.dtype}; tables hold "
                            "real numbers")
        self._svobj = svobj
        self._shape = value.shape
        self._dtype = value.dtype
        self._mv_array = ArrayTableHandler(max(value.size, 1), dtype=table_dtype(value.dtype),
                                           init_value=value.reshape(-1) if value.size else None)
        api.barrier()  # the master's value is in before anyone reads it
        self._last_mv_data = self._mv_array.get()
        api.barrier()  # and nobody adds before everyone has read it
        self._load(self._last_mv_data)

    @property
    def variable(self):
        """The PyTensor shared variable."""
        return self._svobj

    def _load(self, flat: np.ndarray) -> None:
        size = int(np.prod(self._shape))  # 1 for a scalar; the table holds at least 1 value
        value = cast_back(flat[:size].reshape(self._shape), self._dtype)
        self._svobj.set_value(np.array(value, copy=True), borrow=True)

    def mv_sync(self) -> None:
        """Add ``current - last synced`` to the table, then load the table's latest value.

        Raises:
            SynkError: called before ``mv.init()`` or after ``mv.shutdown()``,
                or on a variable unpickled without its table.
            WorkerFailedError: another worker failed.
        """
        if self._mv_array is None:
            raise api.SynkError(f"mv_sync(): {self._svobj} was unpickled; its table is not "
                                "restored (make it again with mv_shared)")
        current = np.asarray(self._svobj.get_value(borrow=True), dtype=self._mv_array.dtype)
        if current.shape != tuple(self._shape):
            raise ValueError(f"mv_sync(): {self._svobj} has shape {current.shape} but its table was "
                             f"made for shape {tuple(self._shape)}; an mv_shared variable keeps "
                             "its shape")
        delta = np.zeros_like(self._last_mv_data)
        delta[:current.size] = current.reshape(-1)
        delta -= self._last_mv_data
        self._mv_array.add(delta)
        self._last_mv_data = self._mv_array.get()
        self._load(self._last_mv_data)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_mv_array"] = None  # a table cannot travel; Multiverso dropped it too
        return state


def mv_shared(*args, **kwargs):
    """``pytensor.shared(*args, **kwargs)``, kept in a table, with a working ``mv_sync()``.

    Every worker must call it for the same variables in the same order. The
    table starts with the master's value and every worker's variable is set to
    it. The returned variable is an ordinary PyTensor shared variable (use it
    in graphs and updates) with two attributes added: ``mv_sync()`` (add this
    worker's change since the last sync, then load the latest value) and
    ``mv_shared_var`` (its :class:`MVSharedVariable`). It is registered for
    :func:`sync_all_mv_shared_vars`.

    Returns:
        The shared variable.

    Raises:
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        TypeError: the value is not numeric.
        WorkerFailedError: another worker failed.
    """
    import pytensor

    var = pytensor.shared(*args, **kwargs)
    mvs = MVSharedVariable(var)
    var.mv_shared_var = mvs
    var.mv_sync = mvs.mv_sync
    mv_shared.shared_vars.append(mvs)  # type: ignore[attr-defined]  # (mypy knows no function attributes)
    return var


mv_shared.shared_vars = []  # type: ignore[attr-defined]  # every MVSharedVariable made by mv_shared, as in Multiverso


def sync_all_mv_shared_vars() -> None:
    """``mv_sync()`` every variable made by :func:`mv_shared`, in the order they were made.

    Raises:
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """
    for sv in mv_shared.shared_vars:  # type: ignore[attr-defined]  # (see above)
        sv.mv_sync()
