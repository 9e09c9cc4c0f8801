"""Streams and devices of the CPU stand-in for CuPy: work is done when it is enqueued."""

from __future__ import annotations

import ctypes
import itertools
import math

import numpy as np

from . import nccl, runtime  # noqa: F401

_ptrs = itertools.count(0x1000)
_current = []


class Stream:
    def __init__(self, non_blocking: bool = False):
        self.ptr = next(_ptrs)

    @property
    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc):
        _current.pop()
        return False


class Device:
    def __init__(self, index: int = 0):
        self.id = index

    def use(self) -> None:
        if self.id >= runtime.getDeviceCount():
            raise RuntimeError(f"fake cupy: no device {self.id}")


class UnownedMemory:
    """Device memory someone else owns (``owner`` is kept alive), as CuPy's."""

    def __init__(self, ptr: int, size: int, owner, device_id: int = 0):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int):
        self.mem, self.ptr = mem, mem.ptr + int(offset)


def memory_view(memptr: MemoryPointer, shape, dtype) -> np.ndarray:
    """A numpy array over the memory at ``memptr`` (how the stand-in's arrays see
    memory they do not own: the address read as NCCL's stand-in reads it)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > memptr.mem.size - (memptr.ptr - memptr.mem.ptr):
        raise ValueError("fake cupy: the view runs past the memory it was given")
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(memptr.ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
