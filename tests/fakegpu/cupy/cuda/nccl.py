"""NCCL of the CPU stand-in for CuPy: ranks are threads of one process (or one rank alone).

Like NCCL, every call takes raw pointers, a count, a datatype and an op; the
ranks meet at a barrier, each reads the others' buffers by pointer, writes its
own result, and meets the others again before anyone may reuse a buffer.
Between ``groupStart()`` and ``groupEnd()`` (per thread, that is per rank, and
nested as NCCL's) calls are only queued; ``groupEnd`` runs each communicator's
queue with one meeting for all of them, as NCCL launches a group at once.
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
#: NCCL's MAX and MIN of floats are fmaxf/fminf and fmax/fmin (src/device/reduce_kernel.h):
#: a NaN gives the other operand, where numpy's maximum and minimum give NaN
_FLOAT_OPS = {2: np.fmax, 3: np.fmin}

_worlds: dict = {}
_lock = threading.Lock()
_group = threading.local()  # per rank (thread): depth, and the calls queued per communicator
#: every call, for tests to look at: (rank, name, count, datatype, op)
calls: list = []


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 0


def get_unique_id() -> bytes:
    return os.urandom(128)  # CuPy 14 gives bytes


def groupStart() -> None:
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.queued = {}


def groupEnd() -> None:
    depth = getattr(_group, "depth", 0)
    if depth < 1:
        raise NcclError("NCCL_ERROR_INVALID_USAGE: groupEnd without groupStart")
    _group.depth = depth - 1
    if depth == 1:
        queued, _group.queued = _group.queued, {}
        for comm, ops in queued.values():
            comm._run(ops)


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

    def _submit(self, op) -> None:
        """Run ``op`` (name, count, datatype, op, root, send, recv) now, or queue it in the group."""
        name, root = op[0], op[4]
        calls.append((self._rank, name, op[1], op[2],
                      root if name == "broadcast" else op[3] if root is None else (op[3], root)))
        if getattr(_group, "depth", 0):
            _group.queued.setdefault(id(self), (self, []))[1].append(op)
        else:
            self._run([op])

    def _run(self, ops) -> None:
        """One meeting for ``ops``: every rank must have queued the same calls."""
        w = self._world
        mine = tuple(o[:5] for o in ops)
        w.args[self._rank] = (mine, [o[5] for o in ops])
        w.barrier.wait()
        for r, other in w.args.items():
            if other[0] != mine:
                raise NcclError(f"rank {self._rank} called {list(mine)} but rank {r} called {list(other[0])}")
        outs = [self._compute(w, k, o) for k, o in enumerate(ops)]
        w.barrier.wait()
        for o, out in zip(ops, outs):
            if out is not None:
                _view(o[6], out.size, o[2])[...] = out
        w.barrier.wait()

    def _compute(self, w, k, o):
        name, count, datatype, op, root = o[:5]
        if name == "broadcast":
            return _view(w.args[root][1][k], count, datatype).copy()
        parts = [_view(w.args[r][1][k], count, datatype).copy() for r in range(w.size)]
        if name == "allGather":
            return np.concatenate(parts) if parts else parts
        if name == "reduce" and self._rank != root:
            return None
        out = parts[0]
        fn = _FLOAT_OPS[op] if op in _FLOAT_OPS and out.dtype.kind == "f" else _OPS[op]
        for p in parts[1:]:
            fn(out, p, out=out)
        return out

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._submit(("allReduce", count, datatype, op, None, sendbuf, recvbuf))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._submit(("reduce", count, datatype, op, root, sendbuf, recvbuf))

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._submit(("broadcast", count, datatype, None, root, sendbuff, recvbuff))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._submit(("allGather", count, datatype, None, None, sendbuf, recvbuf))

    def destroy(self):
        pass

    def abort(self):
        pass
