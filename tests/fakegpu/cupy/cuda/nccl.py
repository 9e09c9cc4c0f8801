"""NCCL of the CPU stand-in for CuPy: ranks are threads of one process (or one rank alone).

Like NCCL, every call takes raw pointers, a count, a datatype and an op; the
ranks meet at a barrier, each reads the others' buffers by pointer, writes its
own result, and meets the others again before anyone may reuse a buffer.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

available = True

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8

_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
           6: np.float16, 7: np.float32, 8: np.float64}
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}

_worlds: dict = {}
_lock = threading.Lock()
#: every call, for tests to look at: (rank, name, count, datatype, op)
calls: list = []


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 0


def get_unique_id() -> bytes:
    return os.urandom(128)  # CuPy 14 gives bytes


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    dtype = np.dtype(_DTYPES[datatype])
    if count == 0:
        return np.empty(0, dtype=dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)


class _World:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.args: dict = {}


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int):
        if not isinstance(commId, bytes):  # as CuPy 14, seen on an H100
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != 128:
            raise NcclError("bad unique id")
        with _lock:
            world = _worlds.setdefault(commId, _World(ndev))
        if world.size != ndev or not 0 <= rank < ndev:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT")
        self._world, self._rank = world, rank
        world.barrier.wait()

    def _meet(self, name, count, datatype, op, args):
        calls.append((self._rank, name, count, datatype, op))
        w = self._world
        w.args[self._rank] = (name, count, datatype, op) + args
        w.barrier.wait()
        mine = w.args[self._rank]
        for r, other in w.args.items():
            if other[:4] != mine[:4]:
                raise NcclError(f"rank {self._rank} called {mine[:4]} but rank {r} called {other[:4]}")
        return w

    def _done(self):
        self._world.barrier.wait()

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        w = self._meet("allReduce", count, datatype, op, (sendbuf,))
        parts = [_view(w.args[r][4], count, datatype).copy() for r in range(w.size)]
        out = parts[0]
        for p in parts[1:]:
            _OPS[op](out, p, out=out)
        self._done()
        _view(recvbuf, count, datatype)[...] = out
        self._done()

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        w = self._meet("reduce", count, datatype, (op, root), (sendbuf,))
        out = None
        if self._rank == root:
            parts = [_view(w.args[r][4], count, datatype).copy() for r in range(w.size)]
            out = parts[0]
            for p in parts[1:]:
                _OPS[op](out, p, out=out)
        self._done()
        if out is not None:
            _view(recvbuf, count, datatype)[...] = out
        self._done()

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        w = self._meet("broadcast", count, datatype, root, (sendbuff,))
        src = _view(w.args[root][4], count, datatype).copy()
        self._done()
        _view(recvbuff, count, datatype)[...] = src
        self._done()

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        w = self._meet("allGather", count, datatype, None, (sendbuf,))
        parts = [_view(w.args[r][4], count, datatype).copy() for r in range(w.size)]
        self._done()
        out = _view(recvbuf, count * w.size, datatype)
        for r, p in enumerate(parts):
            out[r * count:(r + 1) * count] = p
        self._done()

    def destroy(self):
        pass

    def abort(self):
        pass
