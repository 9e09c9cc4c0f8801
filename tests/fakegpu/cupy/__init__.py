"""A CPU stand-in for the parts of CuPy synkhronos uses (see ../README.md); not CuPy."""

from __future__ import annotations

import numpy as np

from . import cuda  # noqa: F401

FAKE = True
__version__ = "0.0-fake"
uint8 = np.uint8
float32 = np.float32


class _Memory:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _unwrap(x):
    return x._a if isinstance(x, ndarray) else x


class ndarray:
    """A numpy array in a wrapper that, like CuPy's arrays, will not turn into numpy implicitly."""

    __slots__ = ("_a", "_owner")

    def __init__(self, a, dtype=float, memptr=None):
        """``ndarray(numpy_array)`` wraps it (the stand-in's own use); ``ndarray(shape,
        dtype, memptr=cuda.MemoryPointer(...))``, as CuPy, is an array over that memory."""
        self._owner = None
        if memptr is not None:
            a = cuda.memory_view(memptr, a, dtype)
            self._owner = memptr
        elif isinstance(a, np.generic):  # numpy's 0-d results are scalars; CuPy's are 0-d arrays
            a = np.asarray(a)
        elif not isinstance(a, np.ndarray):  # a shape
            a = np.empty(a, dtype=dtype)
        self._a = a

    # -- what CuPy arrays have ----------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)

    @property
    def data(self) -> _Memory:
        return _Memory(self._a.__array_interface__["data"][0])

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def get(self) -> np.ndarray:
        return np.array(self._a, copy=True)

    def astype(self, dtype, copy=True):
        return ndarray(self._a.astype(dtype, copy=copy))

    real = property(lambda self: ndarray(self._a.real))

    def round(self, decimals=0):
        return ndarray(self._a.round(decimals))

    def view(self, dtype):
        return ndarray(self._a.view(dtype))

    def reshape(self, *shape):
        return ndarray(self._a.reshape(*shape))

    def copy(self):
        return ndarray(self._a.copy())

    def __getitem__(self, key):
        return ndarray(self._a[key])

    def __setitem__(self, key, value):
        self._a[key] = _unwrap(value)

    def __mul__(self, other):
        return ndarray(self._a * _unwrap(other))

    __rmul__ = __mul__

    def __imul__(self, other):
        self._a *= _unwrap(other)
        return self

    def __ge__(self, other):
        return ndarray(self._a >= _unwrap(other))

    def any(self):
        return ndarray(np.asarray(self._a.any()))  # (CuPy's is a 0-d array)

    def __bool__(self):  # (CuPy's of a 0-d or one-element array: its value, read from the device)
        return bool(self._a)

    def __len__(self):
        return len(self._a)

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def __repr__(self):
        return f"fakecupy.ndarray({self._a!r})"


def asarray(x, dtype=None):
    """Host to "device": a copy, as CuPy makes."""
    if isinstance(x, ndarray):
        return x if dtype is None else x.astype(dtype, copy=False)
    return ndarray(np.array(x, dtype=dtype, copy=True))


def from_dlpack(x):
    return ndarray(np.from_dlpack(x))


def ascontiguousarray(x):
    return ndarray(np.ascontiguousarray(_unwrap(x)))


def empty(shape, dtype=float):
    return ndarray(np.empty(shape, dtype=dtype))


def zeros(shape, dtype=float):
    return ndarray(np.zeros(shape, dtype=dtype))


def full(shape, fill_value, dtype=None):
    return ndarray(np.full(shape, fill_value, dtype=dtype))


def stack(parts, axis=0):
    return ndarray(np.stack([_unwrap(p) for p in parts], axis=axis))


def concatenate(parts, axis=0):
    return ndarray(np.concatenate([_unwrap(p) for p in parts], axis=axis))


def empty_like(x):
    return ndarray(np.empty_like(_unwrap(x)))


def copyto(dst, src, where=True):
    np.copyto(_unwrap(dst), _unwrap(src), where=_unwrap(where))


def isnan(x, out=None):
    if out is None:
        return ndarray(np.isnan(_unwrap(x)))
    np.isnan(_unwrap(x), out=_unwrap(out))
    return out


class random:  # noqa: N801 - a namespace, as cupy.random is a module
    @staticmethod
    def standard_normal(size, dtype=float):
        return ndarray(np.random.default_rng(0).standard_normal(size).astype(dtype))
