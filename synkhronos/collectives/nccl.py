"""NCCL Communicator for GPU processes, one GPU each, through CuPy's NCCL binding.

Arrays in and out are device arrays: NCCL reads them from their own buffers
where it can (else through DLPack and a copy in the dtype it reduces), and
results come back as new CuPy arrays, or, for an all-reduce allowed to write
its arrays, in those very arrays. Before every collective the processes
agree, through the shared-memory communicator this one wraps, on what each
contributes (dtypes and shapes, weights, failure flags), then again that
every process has its buffers ready: a process with nothing to add sends
identity elements of the agreed shape, and an error in one process is an
error in all of them, never a process left waiting inside NCCL.
"""

from __future__ import annotations

import functools
import math
import pickle
import weakref
import zlib
from typing import NoReturn

import numpy as np

from .._arrays import (cupy_at, device_pointer, readable_in_place, still_readable, still_writable, to_cupy,
                       writable_in_place)
from .._protocol.control import SPIN_SECONDS, WAIT_SLICE
from ..errors import PeerFailed, SynkError
from .._procs.waits import wait_until
from .base import CommPlan, Communicator
from .ops import agreed_layout, avg_work_dtype, identity

__all__ = ["NcclCommunicator", "new_unique_id", "avg_factors", "reduce_plan"]

#: dtype -> NCCL datatype name (resolved against cupy.cuda.nccl when used).
NCCL_DTYPES = {
    np.dtype(np.int8): "NCCL_INT8",
    np.dtype(np.uint8): "NCCL_UINT8",
    np.dtype(np.int32): "NCCL_INT32",
    np.dtype(np.uint32): "NCCL_UINT32",
    np.dtype(np.int64): "NCCL_INT64",
    np.dtype(np.uint64): "NCCL_UINT64",
    np.dtype(np.float16): "NCCL_FLOAT16",
    np.dtype(np.float32): "NCCL_FLOAT32",
    np.dtype(np.float64): "NCCL_FLOAT64",
}
#: reduce op -> NCCL op name. "avg" is a sum (NCCL's own average is not used).
NCCL_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX",
            "min": "NCCL_MIN"}
#: dtypes that may travel through NCCL (as bytes for broadcast and gathers).
MOVABLE_KINDS = "biufc"
#: bytes each rank's part of a padded all-gather is rounded up to (alignment of the views).
_GATHER_ALIGN = 16


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (the master makes it, every process joins with it), passed on
    as CuPy made it: CuPy 14's ``NcclCommunicator`` takes these bytes and refuses a tuple."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def avg_factors(weights, mine: float) -> tuple[float, float]:
    """``(pre, post)`` for a weighted average as an NCCL sum.

    Each contributing process multiplies its arrays by ``pre`` before the sum,
    and the sum is multiplied by ``post``: ``pre * post == mine / sum(weights)``.
    With equal weights ``pre`` is exactly 1 (no multiply) and ``post`` is the
    reciprocal of the count: a sum followed by a multiply by the reciprocal.
    With uneven weights (rows split unevenly) ``pre = mine / max(weights) <= 1``
    (no overflow in low precision) and ``post = max(weights) / sum(weights)``.
    A total weight of 0 counts every contribution once, as the CPU path does.
    """
    w = [float(x) for x in weights]
    total = sum(w)
    if total <= 0:
        w, mine, total = [1.0] * len(w), 1.0, float(len(w))
    ref = max(w)
    return float(mine) / ref, ref / total


@functools.lru_cache(maxsize=512)
def reduce_plan(dtype, op: str):
    """How ``op`` reduces ``dtype`` through NCCL: ``(work dtype, NCCL datatype name,
    NCCL op name, result dtype, elements per array element)``.

    A pure function of its arguments, so its answers are kept (per ``(dtype, op)``
    as given; refusals are not kept and raise again).

    The results match the CPU path (:func:`.ops.result_dtype`): ``avg`` of
    integers and of booleans is float64; that of float16 is summed and scaled in
    float32 (:func:`.ops.avg_work_dtype`), then rounded to float16;
    ``sum``/``max`` of booleans is a logical or, ``prod``/``min`` a logical and;
    int16 and uint16 reduce exactly in 32 bits; complex numbers sum and
    average as pairs of floats.

    Raises:
        TypeError: NCCL cannot reduce ``dtype`` with ``op`` (the message names
            both and the CPU ops to use instead).
    """
    dtype = np.dtype(dtype)
    nccl_op = NCCL_OPS[op]
    bad = TypeError(f"NCCL cannot {op}-reduce arrays of dtype {dtype}; use op 'c_{op}' "
                    "(or nccl=False for a function) for the CPU path")
    if dtype.kind == "b":
        if op == "avg":  # as on the CPU: the (weighted) fraction of True, in float64
            return np.dtype(np.float64), "NCCL_FLOAT64", nccl_op, np.dtype(np.float64), 1
        logical = {"sum": "NCCL_MAX", "max": "NCCL_MAX", "prod": "NCCL_MIN", "min": "NCCL_MIN"}[op]
        return np.dtype(np.uint8), "NCCL_UINT8", logical, dtype, 1
    if dtype.kind in "iu":
        if op == "avg":
            return np.dtype(np.float64), "NCCL_FLOAT64", nccl_op, np.dtype(np.float64), 1
        work = dtype if dtype in NCCL_DTYPES else np.dtype(f"{dtype.kind}4") if dtype.itemsize < 4 else None
        if work is None or work not in NCCL_DTYPES:
            raise bad
        return work, NCCL_DTYPES[work], nccl_op, dtype, 1
    if dtype.kind == "f" and dtype in NCCL_DTYPES:
        work = avg_work_dtype(dtype) if op == "avg" else dtype  # (float16's avg: in float32, as on the CPU)
        return work, NCCL_DTYPES[work], nccl_op, dtype, 1
    if dtype.kind == "c" and op in ("sum", "avg"):
        part = np.dtype(f"f{dtype.itemsize // 2}")
        if part in NCCL_DTYPES:
            return dtype, NCCL_DTYPES[part], nccl_op, dtype, 2
    raise bad


def _in_place_dtype(dtype, plan) -> bool:
    """Whether NCCL reduces arrays of ``dtype`` in their own memory (``plan`` is
    :func:`reduce_plan`'s): the work and the result are the dtype itself, or a
    bool reduced as its bytes (0 or 1, by max and min)."""
    work, result = plan[0], plan[3]
    return result == dtype and (work == dtype or (dtype.kind == "b" and work.itemsize == 1))


def _check_movable(layout, what: str) -> None:
    for dtype, _ in layout:
        if np.dtype(dtype).kind not in MOVABLE_KINDS:
            raise TypeError(f"NCCL cannot {what} arrays of dtype {dtype}; use the CPU path "
                            "(a 'c_' op, or nccl=False for a function)")


class NcclCommunicator(Communicator):
    """Collectives over NCCL among processes that each own one GPU.

    With one process (``size == 1``) there is nobody to agree with: the
    agreement and the readiness check use this process's own description
    (no shared-memory exchange, no pickling); a ``failed`` flag still raises
    the :class:`PeerFailed` the exchange raises, and a broken communicator
    still raises.

    Args:
        shm: the fork's shared-memory communicator: it carries the agreement
            before each collective and the liveness checks while waiting.
        unique_id: the NCCL unique id from :func:`new_unique_id`, the same in
            every process.

    Every process must create it at the same time (NCCL's initialisation is
    collective). Results are CuPy arrays on this process's GPU (or, from
    :meth:`all_reduce` with ``in_place``, the arrays it could write in place).
    """

    #: arrays stay on the device: callers pass JAX/CuPy arrays as they are
    device_arrays = True

    def __init__(self, shm, unique_id):
        import cupy
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):
            raise ImportError("CuPy was built without NCCL: install nvidia-nccl-cu13 (pip install "
                              "synkhronos[gpu])")
        self._cp = cupy
        self._nccl = nccl
        self._shm = shm
        self.rank, self.size, self.master_rank = shm.rank, shm.size, shm.master_rank
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self.broken: str | None = None
        self._consts: dict[str, int] = {}  # NCCL's constants by name, resolved once

    # -- agreement and waiting ---------------------------------------------

    def _agree(self, arrays, weight=1.0, failed=False):
        """Every rank's ``(layout or None, weight)``; PeerFailed everywhere if one failed.

        The pickled description travels through the shared-memory all-gather,
        which publishes its size before its bytes. With one rank the
        description is this rank's own: nothing travels.
        """
        layout = None if arrays is None else [(np.dtype(a.dtype), tuple(int(d) for d in a.shape))
                                              for a in arrays]
        if self.size == 1:  # as the exchange would end: a failure first, then a broken communicator
            if failed:
                raise PeerFailed([self.rank])
            if self.broken is not None:
                self._raise_broken(self.rank, self.broken)
            return [(layout, float(weight))]
        blob = pickle.dumps((layout, float(weight), self.broken), protocol=pickle.HIGHEST_PROTOCOL)
        got = self._shm.all_gather([np.frombuffer(blob, dtype=np.uint8)], failed=failed)
        metas = [pickle.loads(part.tobytes()) for part in got[0]]
        broken = [r for r, m in enumerate(metas) if m[2] is not None]
        if broken:
            self._raise_broken(broken[0], metas[broken[0]][2])
        return [(m[0], m[1]) for m in metas]

    @staticmethod
    def _raise_broken(rank: int, why: str) -> NoReturn:
        raise SynkError(f"the NCCL communicator of rank {rank} was aborted after an earlier "
                        f"failure ({why}); call synk.close() and synk.fork() again")

    def _ready(self, prepare):
        """Run ``prepare()`` (buffers, conversions), then agree that every process succeeded
        (with one rank, its own success is everyone's: an error is raised as it is)."""
        if self.size == 1:
            return prepare()
        error = None
        try:
            out = prepare()
        except Exception as exc:
            error, out = exc, None
        try:
            self._shm.all_gather([np.zeros(1, dtype=np.uint8)], failed=error is not None)
        except PeerFailed:
            if error is not None:
                raise error from None
            raise
        return out

    def _wait(self) -> None:
        """Wait for this process's NCCL work, checking between slices that nobody died."""
        stream = self._stream
        if stream.done:
            return

        def check() -> None:
            try:
                self._shm.check()
            except BaseException as exc:
                self.abort(f"{type(exc).__name__}: {exc}")
                raise

        wait_until(lambda: stream.done, check, spin=SPIN_SECONDS, check_every=WAIT_SLICE,
                   first_sleep=50e-6, max_sleep=50e-6)

    def abort(self, why: str) -> None:
        """Abandon the NCCL communicator (its peers will not come); later collectives fail."""
        if self.broken is None:
            self.broken = why
            try:
                self._comm.abort()
            except Exception:
                pass

    # -- arrays ------------------------------------------------------------

    def _dev(self, a):
        """A C-contiguous CuPy array of ``a`` on this GPU (JAX arrays without a copy)."""
        cp = self._cp
        if a.size == 0:
            return cp.empty(a.shape, dtype=a.dtype)
        return cp.ascontiguousarray(to_cupy(a))

    def _bytes(self, a):
        return self._dev(a).reshape(-1).view(self._cp.uint8)

    def _const(self, name: str) -> int:
        value = self._consts.get(name)
        if value is None:
            value = self._consts[name] = int(getattr(self._nccl, name))
        return value

    # -- collectives -------------------------------------------------------

    def barrier(self) -> None:
        self._wait()
        self._shm.barrier()

    def _reduce(self, arrays, op, weight, failed, root, writable=None):
        metas = self._agree(arrays, weight, failed)
        present, layout = agreed_layout(metas, op)
        if not present:
            return None
        plans = [reduce_plan(d, op) for d, _ in layout]
        pre = post = 1.0
        if op == "avg":
            pre, post = avg_factors([metas[r][1] for r in present], metas[self.rank][1])
        gets_result = root is None or self.rank == root
        direct = self._direct(arrays, writable if gets_result else None, layout, plans, pre)
        bufs = self._ready(lambda: self._nan_masks(self._buffers(arrays, op, layout, plans, pre, gets_result, direct),
                                                   op, layout, plans, gets_result))
        if any(direct):  # JAX's readers and writers of these buffers (its own stream) are done
            self._cp.cuda.runtime.deviceSynchronize()
        self._mark_nan(bufs, layout, plans)
        ptr = self._stream.ptr
        with self._stream:
            self._nccl.groupStart()  # one launch for every array of this op (NCCL's group)
            try:
                for (send, recv, _, _, nan), (_, dtype_name, op_name, _, per), (_, shape) in zip(bufs, plans, layout):
                    count = math.prod(shape) * per
                    if count == 0:
                        continue
                    calls = [(send, recv, dtype_name, op_name)]
                    if nan is not None:  # (NCCL's float max and min drop NaN: the mask of NaN, or-ed, beside)
                        calls.append((nan[0].data.ptr, nan[1].data.ptr, "NCCL_UINT8", "NCCL_MAX"))
                    for at, into, dtype_name, op_name in calls:
                        if root is None:
                            self._comm.allReduce(at, into, count, self._const(dtype_name), self._const(op_name), ptr)
                        else:
                            self._comm.reduce(at, into, count, self._const(dtype_name), self._const(op_name), root,
                                              ptr)
            finally:
                self._nccl.groupEnd()
            out = None
            if gets_result:
                out = [self._result(None if arrays is None else arrays[i], bufs[i], plans[i], layout[i][1],
                                    post, direct[i]) for i in range(len(bufs))]
        self._wait()
        return out

    def _direct(self, arrays, writable, layout, plans, pre) -> list:
        """Per array, whether this rank reduces it in place, on its own buffer: allowed
        (``writable``), a device array that may be written (:func:`writable_in_place`),
        no multiply before the sum, and NCCL works in its own dtype (a bool as its bytes).
        Each rank's own choice: NCCL allows ``sendbuff == recvbuff`` per rank."""
        if arrays is None or not writable or pre != 1.0:
            return [False] * len(layout)
        return [bool(w) and _in_place_dtype(d, p) and writable_in_place(a)
                for w, (d, _), p, a in zip(writable, layout, plans, arrays)]

    def _buffers(self, arrays, op, layout, plans, pre, gets_result, direct) -> list:
        """Per array ``(send pointer, receive pointer, receive buffer, send buffer)``: the
        array's own address (and the array) where it is reduced in place; else a new
        receive buffer, sent from the array's own buffer where NCCL can read it as it
        is (:func:`readable_in_place`, its own dtype, no weighting), else from a
        converted copy."""
        cp = self._cp
        bufs = []
        with self._stream:
            for i, ((_, shape), (work, _, _, _, _)) in enumerate(zip(layout, plans)):
                if direct[i]:
                    at = device_pointer(arrays[i])
                    bufs.append((at, at, arrays[i], None))
                    continue
                if arrays is None:
                    send = cp.full(shape, identity(op, work), dtype=work)
                elif pre == 1.0 and _in_place_dtype(arrays[i].dtype, plans[i]) and readable_in_place(arrays[i]):
                    at = device_pointer(arrays[i])  # read where it is: no DLPack, no copy
                    recv = cp.empty(shape, dtype=work) if gets_result else None
                    bufs.append((at, at if recv is None else recv.data.ptr, recv, arrays[i]))
                    continue
                else:
                    send = self._dev(arrays[i]).astype(work, copy=False)
                    if pre != 1.0:
                        send = send * work.type(pre)
                recv = cp.empty(shape, dtype=work) if gets_result else send
                bufs.append((send.data.ptr, recv.data.ptr, recv, send))  # (send kept alive)
        return bufs

    def _nan_masks(self, bufs, op, layout, plans, gets_result) -> list:
        """``bufs`` (:meth:`_buffers`'), each with a fifth entry: for a float max or min,
        ``(send, receive)`` uint8 masks of the array's NaN (the receive mask the send one
        where this rank gets no result; filled by :meth:`_mark_nan`), else None. NCCL's
        float max and min are ``fmaxf``/``fminf`` (NVIDIA/nccl, src/device/reduce_kernel.h),
        which return the other operand of a NaN; the CPU path's are numpy's
        ``maximum``/``minimum``, which return NaN: the masks, or-ed by NCCL's MAX in the
        same group, say where the result is NaN (:meth:`_result`). One rank: none (its
        values are the result)."""
        if op not in ("max", "min") or self.size == 1:  # (every other reduction: nothing to add)
            return [(*buf, None) for buf in bufs]
        cp = self._cp
        out = []
        with self._stream:
            for (at, into, recv, send), (work, *_), (_, shape) in zip(bufs, plans, layout):
                nan = None
                if work.kind == "f" and math.prod(shape):
                    mask = cp.empty(shape, dtype=np.uint8)
                    nan = (mask, cp.empty(shape, dtype=np.uint8) if gets_result else mask)
                out.append((at, into, recv, send, nan))
        return out

    def _mark_nan(self, bufs, layout, plans) -> None:
        """Fill the send masks of :meth:`_nan_masks` from the values NCCL is about to send,
        on the stream, before NCCL may write an array reduced in place."""
        masked = [(buf, plan[0], shape) for buf, plan, (_, shape) in zip(bufs, plans, layout) if buf[4] is not None]
        if not masked:
            return
        cp = self._cp
        with self._stream:
            for (at, _, recv, send, nan), work, shape in masked:
                cp.isnan(cupy_at(at, work, shape, send if send is not None else recv), out=nan[0].view(np.bool_))

    def _result(self, array, buf, plan, shape, post, direct):
        """An array's result: the array itself when reduced in place (scaled there by
        ``post`` through a view of its memory), else the receive buffer in the result
        dtype; NaN where any rank's value was NaN (a float max or min: :meth:`_nan_masks`)."""
        work, result = plan[0], plan[3]
        recv, nan = buf[2], buf[4]
        if direct:
            view = cupy_at(buf[1], work, shape, array) if post != 1.0 or nan is not None else None
            if post != 1.0:
                view *= work.type(post)
            if nan is not None:
                self._cp.copyto(view, work.type("nan"), where=nan[1].view(np.bool_))
            return array
        if post != 1.0:
            recv *= recv.dtype.type(post)
        if nan is not None:
            self._cp.copyto(recv, work.type("nan"), where=nan[1].view(np.bool_))
        return recv.astype(result, copy=False)

    def reduce(self, arrays, op, root, weight=1.0, failed=False, in_place=False):
        """``op`` over every process's arrays; CuPy arrays on root, None elsewhere.

        ``in_place`` as in :meth:`all_reduce`, on root: an array it may write and
        NCCL can is reduced on its own buffer and comes back itself."""
        return self._reduce(arrays, op, weight, failed, root, _writable(arrays, in_place))

    def all_reduce(self, arrays, op, weight=1.0, failed=False, in_place=False):
        """``op`` over every process's arrays, everywhere.

        ``in_place`` (True, or per array a boolean): the array may be written.
        Such an array that can be (a device array NCCL reduces in its own
        dtype, no cached host copy, see :func:`.writable_in_place`, and no
        weighting before the sum) is reduced in place on its own buffer and
        comes back itself; every other result is a new CuPy array.
        """
        return self._reduce(arrays, op, weight, failed, None, _writable(arrays, in_place))

    def all_gather(self, arrays, failed=False, join=None):
        """For each array, the list over ranks of its copies (None where a rank had none),
        or ``join(i, parts)`` of that list when ``join`` is given.

        NCCL's all-gather moves equal counts: each rank's bytes are padded to
        the largest, then trimmed with the agreed lengths.
        """
        metas = self._agree(arrays, 1.0, failed)
        lays = [lay for lay, _ in metas]
        counts = {len(lay) for lay in lays if lay is not None}
        if len(counts) > 1:
            raise ValueError(f"cannot gather: the processes hold different numbers of arrays "
                             f"{[None if lay is None else len(lay) for lay in lays]}")
        n = counts.pop() if counts else 0
        for lay in lays:
            if lay is not None:
                _check_movable(lay, "gather")
        cp = self._cp
        sizes = [[0 if lay is None else math.prod(lay[i][1]) * np.dtype(lay[i][0]).itemsize
                  for lay in lays] for i in range(n)]
        slots = [-(-max(s) // _GATHER_ALIGN) * _GATHER_ALIGN for s in sizes]

        def prepare():
            bufs = []
            with self._stream:
                for i in range(n):
                    slot = slots[i]
                    if slot == 0:
                        bufs.append((None, None))
                        continue
                    mine = sizes[i][self.rank]
                    src = self._bytes(arrays[i]) if arrays is not None and mine else None
                    if src is not None and mine == slot:
                        send = src
                    else:
                        send = cp.zeros(slot, dtype=cp.uint8)
                        if src is not None:
                            send[:mine] = src
                    bufs.append((send, cp.empty(slot * self.size, dtype=cp.uint8)))
            return bufs

        bufs = self._ready(prepare)
        u8 = self._const("NCCL_UINT8")
        with self._stream:
            for (send, recv), slot in zip(bufs, slots):
                if slot:
                    self._comm.allGather(send.data.ptr, recv.data.ptr, slot, u8, self._stream.ptr)
        self._wait()
        out = []
        for i, ((_, recv), slot) in enumerate(zip(bufs, slots)):
            parts: list = []
            for r, lay in enumerate(lays):
                if lay is None:
                    parts.append(None)
                    continue
                dtype, shape = lay[i]
                if sizes[i][r] == 0:
                    parts.append(cp.empty(shape, dtype=dtype))
                else:
                    parts.append(recv[r * slot:r * slot + sizes[i][r]].view(dtype).reshape(shape))
            out.append(parts if join is None else join(i, parts))
        return out

    def gather(self, arrays, root, failed=False, join=None):
        """As :meth:`all_gather` (NCCL has no gather), the result on root only."""
        if self.rank != root:
            join = None  # nobody here wants the parts
        out = self.all_gather(arrays, failed=failed, join=join)
        return out if self.rank == root else None

    def broadcast(self, arrays, root, failed=False, receive=None):
        """Root's arrays in every process (root gets its own, as CuPy arrays);
        ``receive(i, array)``, if given, places array ``i`` elsewhere than root and
        returns what to give back for it."""
        metas = self._agree(arrays if self.rank == root else None, 1.0, failed)
        layout = metas[root][0]
        if layout is None:
            raise ValueError(f"broadcast: root rank {root} gave no arrays")
        _check_movable(layout, "broadcast")
        cp = self._cp
        sizes = [math.prod(s) * np.dtype(d).itemsize for d, s in layout]

        def prepare():
            with self._stream:
                if self.rank == root:
                    return [self._bytes(a) if n else None for a, n in zip(arrays, sizes)]
                return [cp.empty(n, dtype=cp.uint8) if n else None for n in sizes]

        bufs = self._ready(prepare)
        u8 = self._const("NCCL_UINT8")
        with self._stream:
            for buf, n in zip(bufs, sizes):
                if n:  # in place: root sends from the buffer it receives into
                    self._comm.broadcast(buf.data.ptr, buf.data.ptr, n, u8, root, self._stream.ptr)
        self._wait()
        out = [cp.empty(s, dtype=d) if buf is None else buf.view(d).reshape(s)
               for buf, (d, s) in zip(bufs, layout)]
        if receive is not None and self.rank != root:
            out = [receive(i, a) for i, a in enumerate(out)]
        return out

    def plan(self, kind, layout, op, step=None, reducers=None, weight=1.0):
        """With one process, a kept collective of ``layout`` (per array ``(dtype, shape)``)
        that NCCL runs on the arrays' own buffers, when every array of the layout can be
        (a non-empty array NCCL reduces in its own dtype); else None. Several processes
        take the full path, which agrees on every step.

        ``"all_reduce"`` by ``op``: :class:`_NcclPlan`, in place on the values.
        ``"reduce"`` to this process, ``op`` one op or one per array (the outputs of a
        call): :class:`_NcclReducePlan`, every array in one NCCL group."""
        if kind not in ("all_reduce", "reduce") or self.size != 1 or self.broken is not None:
            return None
        ops = [op] * len(layout) if isinstance(op, str) else list(op)
        if len(ops) != len(layout) or (kind == "all_reduce" and not isinstance(op, str)):
            return None
        calls = []
        for (dtype, shape), one in zip(layout, ops):
            if dtype is None or shape is None:
                return None
            dtype = np.dtype(dtype)
            try:
                plan = reduce_plan(dtype, one)
            except (TypeError, KeyError):
                return None
            count = math.prod(shape) * plan[4]
            if not count or not _in_place_dtype(dtype, plan):
                return None
            calls.append((count, self._const(plan[1]), self._const(plan[2])))
        if kind == "reduce":
            return _NcclReducePlan(self, layout, ops, calls)
        return _NcclPlan(self, layout, op, calls)

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None and self.broken is None:
            try:
                comm.destroy()
            except Exception:
                pass


def _writable(arrays, in_place):
    """Per array, whether it may be written: ``in_place`` is a bool or a list (one too
    short says False for the rest: never a write unasked); None when none may."""
    if arrays is None or in_place is False:
        return None
    n = len(arrays)
    return [in_place] * n if isinstance(in_place, bool) else (list(in_place) + [False] * n)[:n]


class _NcclPlan(CommPlan):
    """A kept all-reduce of one process: NCCL in place on each value's own buffer.

    Agreed once (there is nobody else to agree with); kept: per array the
    count, NCCL's datatype and op, and the stream. With one process an
    average is the sum itself (its factor is 1). :attr:`fingerprint` is the
    crc32 of the layout and op (the word several processes would compare).
    """

    needs_exclusive = True  # it writes into the values

    def __init__(self, comm: NcclCommunicator, layout, op: str, calls: list):
        self._comm = comm
        self._layout = [(np.dtype(d), tuple(s)) for d, s in layout]
        self._calls = calls
        self._seen: list = [None] * len(calls)  # per array: a weak reference to the value checked whole
        self.fingerprint = zlib.crc32(repr((self._layout, op)).encode())

    def run(self, values, outs=None) -> bool:
        comm = self._comm
        if comm.broken is not None or comm._comm is None or len(values) != len(self._calls):
            return False  # (the full path raises the broken or closed communicator's error)
        ptrs = []
        for i, (value, (dtype, shape)) in enumerate(zip(values, self._layout)):
            have = getattr(value, "dtype", None)
            if (have is not dtype and have != dtype) or getattr(value, "shape", None) != shape:
                return False
            if not self._writable(i, value):
                return False
            ptrs.append(device_pointer(value))
        comm._cp.cuda.runtime.deviceSynchronize()  # JAX's readers and writers of these buffers are done
        nccl, stream = comm._comm, comm._stream.ptr
        for ptr, (count, datatype, nccl_op) in zip(ptrs, self._calls):
            nccl.allReduce(ptr, ptr, count, datatype, nccl_op, stream)
        comm._wait()
        return True

    def _writable(self, i: int, value) -> bool:
        """:func:`writable_in_place`, whole for a value not seen before, else only
        what can change on one array (:func:`still_writable`)."""
        seen = self._seen[i]
        if seen is not None and seen() is value:
            return still_writable(value)
        if not writable_in_place(value):
            return False
        try:
            self._seen[i] = weakref.ref(value)
        except TypeError:  # (an array type without weak references: checked whole each time)
            self._seen[i] = None
        return True


class _NcclReducePlan(CommPlan):
    """A kept reduce of one process's arrays to itself (the outputs of a planned call):
    NCCL on each array's own buffer, every array in one NCCL group, whatever its op.

    :meth:`run` takes ``outs``, one entry per value: the value itself where it may
    be written (it is reduced in place and stays the result), or None (it is reduced
    into a new array, which is put there). With one process an average is the sum
    itself (its factors are 1).

    Kept besides the counts and NCCL's datatypes and ops: per position, the type of
    the array :func:`readable_in_place` (and, once asked, :func:`writable_in_place`)
    accepted whole. A later array of that type at that position is the same compiled
    function's output for the same input types, so its device layout and sharding are
    those accepted (JAX fixes them per executable; synkhronos asks for no other):
    only what can change per array is checked (:func:`still_readable`,
    :func:`still_writable`). Valid only for values of exactly the kept dtypes and
    shapes (checked at every run: False otherwise, nothing sent).
    """

    def __init__(self, comm: NcclCommunicator, layout, ops: list, calls: list):
        self._comm = comm
        self._layout = [(np.dtype(d), tuple(s)) for d, s in layout]
        self._calls = calls
        self._read: list = [None] * len(calls)   # per array: the type accepted whole for reading
        self._write: list = [None] * len(calls)  # per array: the type accepted whole for writing
        self.fingerprint = zlib.crc32(repr((self._layout, ops, "reduce")).encode())

    def run(self, values, outs=None) -> bool:
        comm = self._comm
        if comm.broken is not None or comm._comm is None or outs is None \
                or not len(values) == len(outs) == len(self._calls):
            return False
        ptrs: list = []
        recvs: list = []  # per array: None (in place), the (dtype, shape) of a new one, then that array
        for i, (value, out, (dtype, shape)) in enumerate(zip(values, outs, self._layout)):
            have = getattr(value, "dtype", None)
            if (have is not dtype and have != dtype) or getattr(value, "shape", None) != shape \
                    or not self._readable(i, value):
                return False  # (nothing sent yet)
            ptrs.append(device_pointer(value))
            recvs.append(None if out is value and self._writable(i, value) else (dtype, shape))
        cp, stream = comm._cp, comm._stream
        if any(r is None for r in recvs):  # JAX's readers and writers of these buffers (its own stream) are done
            cp.cuda.runtime.deviceSynchronize()
        with stream:
            recvs = [r if r is None else cp.empty(r[1], dtype=r[0]) for r in recvs]
            comm._nccl.groupStart()
            try:
                for ptr, recv, (count, datatype, nccl_op) in zip(ptrs, recvs, self._calls):
                    comm._comm.reduce(ptr, ptr if recv is None else recv.data.ptr, count, datatype, nccl_op,
                                      comm.rank, stream.ptr)
            finally:
                comm._nccl.groupEnd()
        comm._wait()
        for i, recv in enumerate(recvs):
            outs[i] = values[i] if recv is None else recv
        return True

    def _readable(self, i: int, value) -> bool:
        return _accepted(self._read, i, value, still_readable, readable_in_place)

    def _writable(self, i: int, value) -> bool:
        return _accepted(self._write, i, value, still_writable, writable_in_place)


def _accepted(seen: list, i: int, value, still, whole) -> bool:
    """Whether ``value`` at position ``i`` passes: ``still(value)`` where an array of its
    type passed ``whole`` there before (``seen[i]``, kept), else ``whole(value)``."""
    if type(value) is seen[i]:
        return still(value)
    if not whole(value):
        return False
    seen[i] = type(value)
    return True
