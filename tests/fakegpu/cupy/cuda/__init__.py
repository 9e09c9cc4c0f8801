"""Streams and devices of the CPU stand-in for CuPy: work is done when it is enqueued."""

from __future__ import annotations

import itertools

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
