"""synk.data: arrays in POSIX shared memory that every worker reads in place."""

from __future__ import annotations

import math
import weakref

import numpy as np

from . import _state as state
from .errors import short_repr
from ._procs.shmem import Segment, Shrink
from ._protocol.data_refs import forget

__all__ = ["Data", "data"]

class _Memory:
    """The segment of one Data object, released when the Data is closed or garbage.

    Kept apart from the Data so that a finalizer can release it without
    holding the Data alive; the workers are told to drop their mappings too.
    """

    __slots__ = ("seg", "uid", "proc")

    def __init__(self, proc, uid: int):
        self.seg: Segment | None = None
        self.uid = uid
        self.proc = proc

    def release(self) -> None:
        seg, self.seg = self.seg, None
        if seg is None:
            return
        seg.close()
        forget(self.proc, (self.uid,))  # the master's own mapping, if a call attached it
        s = state.current()
        if s is not None and s.proc is self.proc:
            s.dropped.append(self.uid)
            self.proc.kept.moved()  # a kept call may point into it (_kept/records.py)

    def forget(self) -> None:
        """Release, and leave the session's list of live memory (the Data is gone)."""
        self.release()
        s = state.current()
        if s is not None and s.proc is self.proc:
            s.data_memory.pop(self.uid, None)


class Data:
    """An array in named shared memory, readable by every process of the fork.

    Use it as a function input to avoid copying: a call then sends only index
    ranges. Create it with :func:`synkhronos.data`.

    Attributes:
        name: optional user label.
        minibatch: True if the array holds exactly the rows of one batch, so a
            call's ``batch`` selects positions in it rather than indices.
    """

    def __init__(self, dtype, ndim: int | np.integer, minibatch: bool = False, name=None, oversize: float = 1.0):
        self._proc = state.running_session().proc
        self._uid = state.next_data_id()
        self._gen = 0
        self._dtype = np.dtype(dtype)
        self._ndim = int(ndim)
        self._shape = (0,) * self._ndim
        self._mem = _Memory(self._proc, self._uid)
        # a dropped Data gives its shared memory back at once (and the workers
        # their mappings), not at close(); close() releases the ones still alive
        state.running_session().data_memory[self._uid] = self._mem
        weakref.finalize(self, self._mem.forget).atexit = False
        self._alloc = 0
        self._shrink: Shrink | None = None  # scratch only: see _fit
        self._oversize = _check_oversize(oversize)
        self.minibatch = bool(minibatch)
        self.name = name
        if self._ndim == 0:  # shape () holds one element: it needs memory from the start
            self._reshape((), None, keep=False)

    # -- properties --------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return self._ndim

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def alloc_size(self) -> int:
        """Elements the shared memory can hold before it must be reallocated."""
        return self._alloc

    @property
    def data(self) -> np.ndarray:
        """The array itself: a view into shared memory (writes are seen by all)."""
        self._check_alive()
        if self._seg is None:
            return np.empty(self._shape, dtype=self._dtype)
        return self._seg.array(self._dtype, self._shape)

    # -- array protocol ----------------------------------------------------

    def __len__(self) -> int:
        if self._ndim == 0:
            raise TypeError(f"len() of a 0-d synk.data {self._label()}")
        return self._shape[0]

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def __array__(self, dtype=None, copy=None):
        arr = self.data
        if dtype is not None:
            arr = arr.astype(dtype)
        return np.array(arr, copy=True) if copy else arr

    def __repr__(self) -> str:
        return f"<synk.data {self._label()} dtype={self._dtype} shape={self._shape}>"

    # -- values ------------------------------------------------------------

    def condition_data(self, value, force_cast: bool = False) -> np.ndarray:
        """``value`` as an array of this dtype and ndim, or a clear error.

        Safe casts (no loss) happen silently, as do casts of Python lists and
        scalars within the same kind whose numbers the dtype holds (floats
        rounded to its precision); anything else needs ``force_cast``.

        Raises:
            TypeError: the dtype cannot be cast without ``force_cast``, or a
                number of a list or scalar is beyond the dtype's range (named).
            ValueError: the number of dimensions differs.
        """
        is_array = isinstance(value, (np.ndarray, Data))
        arr = np.asarray(value)
        if arr.ndim != self._ndim:
            raise ValueError(f"synk.data {self._label()} has ndim={self._ndim}, but the value has "
                             f"ndim={arr.ndim} (shape {arr.shape})")
        if arr.dtype != self._dtype:
            safe = np.can_cast(arr.dtype, self._dtype, "safe")
            same_kind = not safe and not is_array and np.can_cast(arr.dtype, self._dtype, "same_kind")
            if not (safe or same_kind or force_cast):
                raise TypeError(f"synk.data {self._label()} has dtype {self._dtype}; a value of dtype "
                                f"{arr.dtype} would lose information: cast it first or pass "
                                "force_cast=True")
            with np.errstate(over="ignore", invalid="ignore"):  # (a lost number is refused just below)
                cast = arr.astype(self._dtype)
            if same_kind and not force_cast:
                self._check_range(arr, cast)
            arr = cast
        return arr

    def _check_range(self, arr: np.ndarray, cast: np.ndarray) -> None:
        """TypeError when the same-kind cast of a list or scalar changed a number beyond
        rounding: an integer wrapped around (300 into int8 became 44), a finite float
        became infinite (1e300 into float32)."""
        if cast.dtype.kind in "fc":
            changed = np.isfinite(arr) & ~np.isfinite(cast)
        else:
            changed = cast != arr
        if np.any(changed):
            bad, got = arr[changed].flat[0].item(), cast[changed].flat[0].item()
            raise TypeError(f"synk.data {self._label()} has dtype {self._dtype}, which cannot hold "
                            f"{bad!r} of the value (it would become {got!r}): cast it first or pass "
                            "force_cast=True")

    def set_value(self, value, force_cast: bool = False, oversize: float | None = None) -> None:
        """Replace the contents (and shape) with ``value``, reallocating if it does not fit."""
        arr = self.condition_data(value, force_cast)
        self._reshape(arr.shape, oversize, keep=False)
        if arr.size:
            np.copyto(self.data, arr)

    def set_length(self, length: int, oversize: float | None = None) -> None:
        """Change the length along axis 0, keeping the rows that remain."""
        if self._ndim == 0:
            raise TypeError(f"set_length() on a 0-d synk.data {self._label()}")
        length = _check_index_int(length, "length")
        if length < 0:
            raise ValueError(f"length must be non-negative, got {length}")
        self._reshape((length,) + self._shape[1:], oversize, keep=True)

    def set_shape(self, shape, oversize: float | None = None) -> None:
        """Change the shape; the flat contents that fit are kept."""
        shape = tuple(_check_index_int(s, "shape entry") for s in np.atleast_1d(shape)) \
            if self._ndim else ()
        if len(shape) != self._ndim:
            raise ValueError(f"synk.data {self._label()} has ndim={self._ndim}, got shape {shape}")
        if any(s < 0 for s in shape):
            raise ValueError(f"shape entries must be non-negative, got {shape}")
        self._reshape(shape, oversize, keep=True)

    def free_memory(self) -> None:
        """Release the shared memory; the data becomes empty (a 0-d one keeps one element)."""
        self._drop_segment()
        self._alloc = 0
        self._shape = (0,) * self._ndim
        if self._ndim == 0:  # shape () always holds one element
            self._reshape((), None, keep=False)

    # -- internals ---------------------------------------------------------

    @property
    def _seg(self) -> Segment | None:
        return self._mem.seg

    def _label(self) -> str:
        return repr(self.name) if self.name is not None else f"#{self._uid}"

    def _check_alive(self) -> None:
        s = state.current()
        if s is None or s.proc is not self._proc:
            raise RuntimeError(f"synk.data {self._label()} belongs to a fork that was closed")

    def _reshape(self, shape, oversize, keep: bool) -> None:
        self._check_alive()
        need = math.prod(shape)
        if need > self._alloc:
            factor = self._oversize if oversize is None else _check_oversize(oversize)
            alloc = max(int(need * factor), need)
            self._gen += 1
            seg = Segment(f"{self._proc.prefix}d{self._uid}.{self._gen}",
                          alloc * self._dtype.itemsize, create=True,
                          what=f"synk.data {self._label()} of shape {tuple(shape)} and dtype {self._dtype}")
            if keep and self._seg is not None:
                old = self._seg.array(self._dtype, (self._alloc,))
                n = min(self.size, need)
                seg.array(self._dtype, (alloc,))[:n] = old[:n]
            self._drop_segment()
            self._mem.seg, self._alloc = seg, alloc
        self._shape = tuple(int(s) for s in shape)

    def _drop_segment(self) -> None:
        self._mem.release()

    def _fit(self, shape) -> None:
        """Reshape scratch: grow as needed, and shrink when it is much too large."""
        if self._shrink is None:
            self._shrink = Shrink()
        itemsize = self._dtype.itemsize
        if self._shrink(self._alloc * itemsize, math.prod(shape) * itemsize):
            self._drop_segment()
            self._alloc = 0
        self._reshape(shape, None, keep=False)

    def _ref(self):
        """What a worker needs to map this array: (uid, segment name, dtype, shape)."""
        self._check_alive()
        return (self._uid, None if self._seg is None else self._seg.name, self._dtype.str, self._shape)

    def _release(self) -> None:
        self._drop_segment()


# -- for the other modules: Data keeps these private, its public API unchanged --


def ref(d: Data):
    """What a worker needs to map ``d``: (uid, segment name, dtype, shape)."""
    return d._ref()


def check_alive(d: Data) -> None:
    """RuntimeError if ``d`` belongs to a fork that was closed."""
    d._check_alive()


def label(d: Data) -> str:
    """How error messages name ``d``."""
    return d._label()


def fit(d: Data, shape) -> None:
    """Make ``d`` hold ``shape`` (grown as needed, shrunk after a much larger one)."""
    d._fit(shape)


def release(d: Data) -> None:
    """Give back ``d``'s memory now."""
    d._release()


def _check_oversize(oversize) -> float:
    if isinstance(oversize, (bool, np.bool_)) or not isinstance(oversize, (int, float, np.integer, np.floating)):
        raise TypeError(f"oversize must be a number >= 1, got {oversize!r}")
    if not 1.0 <= oversize < math.inf:
        raise ValueError(f"oversize must be a finite number >= 1, got {oversize!r}")
    return float(oversize)


def _check_index_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    return int(value)


#: The most dimensions a numpy array may have.
_MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32


def data(value=None, var=None, dtype=None, ndim=None, shape=None, minibatch=False,
         force_cast=False, oversize=1.0, name=None) -> Data:
    """Make a :class:`Data`: an array in shared memory for function inputs.

    The keywords and their order are the original Synkhronos's.

    Args:
        value: initial contents (array-like), optional.
        var: a PyTensor variable whose dtype and ndim the data must match.
        dtype, ndim: given explicitly instead of (or checked against) ``var``.
        shape: allocate the data with this shape (zero-filled) when no
            ``value`` is given; gives ``ndim`` when that is missing.
        minibatch: the array holds one batch exactly (see :class:`Data`).
        force_cast: cast ``value`` to the dtype even if that loses information.
        oversize: allocate this factor more than needed, so growth is cheap.
        name: a label used in messages.

    Returns:
        A new Data object.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError, ValueError: conflicting or missing dtype/ndim, bad value.
    """
    state.running_session()
    if var is not None:
        vtype = getattr(var, "type", None)
        if vtype is None or not hasattr(vtype, "dtype") or not hasattr(vtype, "ndim"):
            raise TypeError(f"var must be a PyTensor tensor variable, got {var!r}")
        if dtype is not None and np.dtype(dtype) != np.dtype(vtype.dtype):
            raise TypeError(f"dtype={dtype!r} conflicts with var {var} of dtype {vtype.dtype}")
        if ndim is not None and ndim != vtype.ndim:
            raise ValueError(f"ndim={ndim!r} conflicts with var {var} of ndim {vtype.ndim}")
        dtype, ndim = vtype.dtype, vtype.ndim
    if shape is not None:
        shape = _check_shape(shape)
        if ndim is not None and ndim != len(shape):
            raise ValueError(f"shape={shape} has {len(shape)} dimensions, but ndim={ndim!r}"
                             + (f" (from var {var})" if var is not None else ""))
        ndim = len(shape)
    if value is not None:
        arr = np.asarray(value)
        if shape is not None and arr.shape != shape:
            raise ValueError(f"shape={shape} conflicts with the value's shape {arr.shape}")
        if dtype is None:
            dtype = arr.dtype
        if ndim is None:
            ndim = arr.ndim
    if dtype is None or ndim is None:
        raise ValueError("synk.data needs a value, a var, a shape, or both dtype and ndim")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype {dtype!r} is not a numpy dtype") from None
    if dtype.hasobject:
        what = "" if value is None else f": {short_repr(value)}"
        raise TypeError(f"synk.data cannot hold dtype {dtype} (object arrays do not live in shared "
                        f"memory){what}")
    if isinstance(ndim, bool) or not isinstance(ndim, (int, np.integer)) or not 0 <= ndim <= _MAX_NDIM:
        raise ValueError(f"ndim must be an int from 0 to {_MAX_NDIM} (numpy's limit), got {ndim!r}")
    d = Data(dtype, ndim, minibatch=minibatch, name=name, oversize=oversize)
    if value is not None:
        d.set_value(value, force_cast=force_cast)
    elif shape is not None:
        d.set_shape(shape)
    return d


def _check_shape(shape) -> tuple:
    items = (shape,) if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool) else shape
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints, got {shape!r}") from None
    for s in items:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
        if s < 0:
            raise ValueError(f"shape entries must be non-negative, got {shape!r}")
    return tuple(int(s) for s in items)
