"""The MPI communicator's kept all-reduce plans among node masters of nodes of one process.

:meth:`.mpi.MpiCommunicator.plan` makes them after a full-path all-reduce (see
:meth:`.base.Communicator.plan`). A plan reaches its communicator only through
public names: ``begin`` (the step's number, first), ``enter``, ``fill_slot``,
``wait``, ``started``, ``plan_exchanged`` and ``settle_slots`` (the full path's
reading of slots that differ); the MPI module and the duplicated mpi4py
communicator come with it when it is made (``lines``).
"""

from __future__ import annotations

import math
import pickle
import zlib

import numpy as np

from .._arrays import packed_views, round_up
from .base import CommPlan
from .mpi_wire import (HEAD, HEADER_SLOT, INLINE_BYTES, OP_CODES, RING_TAG, WHAT_CODES, fill_slot, payload_at,
                       pieces, reduce_plan)
from .ops import REDUCE_OPS, Reducer

__all__ = ["LargePlan", "StepPlan"]

#: The step number's place in a header slot (see mpi_wire.HEAD: an int64 after the blob's length).
_NUMBER = 8


class StepPlan(CommPlan):
    """A kept all-reduce among node masters of nodes of one process: the full path's
    header slot, made once (only the step number changes), its payload views in the
    send slot and in every node's receive slot, and a reducer per array.

    Each :meth:`run` numbers the step first (as ``Session`` does), makes the one
    exchange of header slots, which carry the values, and compares every node's head
    and blob with this node's, byte for byte (the fingerprint is the blob's
    checksum): all equal, every node combines every node's values, in node order, as
    the full path does (:func:`.ops.combine`); any difference reads the slots as the
    full path reads them (a node that joined, left, failed, is in another step or
    holds another layout) and then goes on, or raises, as the full path would.
    """

    needs_exclusive = True

    @classmethod
    def make(cls, comm, lines, layout, op: str, step):
        """The plan, or None when the values do not travel in the header slot. ``comm``:
        the :class:`.mpi.MpiCommunicator`; ``lines``: its MPI module and mpi4py communicator."""
        meta = (layout, 1.0, False, True)  # (as the full path's: a node of one process weighs 1)
        blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        nbytes = [math.prod(shape) * dtype.itemsize for dtype, shape in layout]
        end = payload_at(len(blob))
        for n in nbytes:
            end = round_up(end + n, 8)
        if sum(nbytes) > INLINE_BYTES or end > HEADER_SLOT:
            return None
        return cls(comm, lines, layout, op, step, meta, blob)

    def __init__(self, comm, lines, layout, op: str, step, meta, blob: bytes):
        self.comm, self.layout, self.op, self.meta, self.blob = comm, layout, op, meta, blob
        self.MPI, self.mpi_comm = lines
        self.key, self.words = step
        self.mark = comm.mark_of(self.key)  # the step key's checksum, as begin() gives it
        self.fingerprint = zlib.crc32(blob)
        size, at = comm.size, payload_at(len(blob))
        self.slot = np.zeros(HEADER_SLOT, dtype=np.uint8)
        self.slots = np.zeros((size, HEADER_SLOT), dtype=np.uint8)
        # the head and blob once; each run writes its step's number (and values) only
        fill_slot(self.slot, 0, blob, self.mark, (WHAT_CODES["all_reduce"], OP_CODES[op], -1))
        self.number = self.slot[_NUMBER:_NUMBER + 8].view("<i8")
        n = HEAD.size + len(blob)
        self.own = self.slot[:n]  # this node's head and blob; every other node's, to compare
        self.heads = [self.slots[r, :n] for r in range(size) if r != comm.rank]
        self.sends: list = []
        self.folds: list = []
        if meta[3]:  # the values travel in the header slots
            self.sends = packed_views(self.slot, layout, at, 8)
            received = [packed_views(self.slots[r], layout, at, 8) for r in range(size)]
            self.folds = [self._fold_of(Reducer(op, dtype, shape, None, size), [received[r][i] for r in range(size)])
                          for i, (dtype, shape) in enumerate(layout)]
        self.spec = ([self.slot, self.MPI.BYTE], [self.slots, self.MPI.BYTE])
        self.keep = (self.slot, self.slots)
        self.count = len(layout)

    def _fold_of(self, reducer, parts):
        """``(how, reducer, parts)``: how every node's ``parts`` (views of the receive slots)
        combine into a value, with the operations of :func:`.ops.combine` in its order:
        0 as numpy scalars (:meth:`.ops.Reducer.scalar`), 1 a ufunc fold into the value,
        2 the reducer into the value."""
        if reducer.scalar_path:
            return 0, reducer.scalar, parts
        if self.op != "avg" and len(parts) > 1:  # (ops._fold, into the value)
            return 1, REDUCE_OPS[self.op], parts
        return 2, reducer, parts

    def run(self, values, outs=None) -> bool:
        comm = self.comm
        if comm.pre_begun or len(values) != self.count:
            return False
        for v, (dtype, shape) in zip(values, self.layout):
            if type(v) is not np.ndarray or v.dtype is not dtype or v.shape != shape or not v.flags.writeable:
                return False
        if not self._exchange(values):
            self._read_long(values)
            return True
        for value, (how, fn, parts) in zip(values, self.folds):
            if how == 1:
                acc = fn(parts[0], parts[1], out=value)
                for x in parts[2:]:
                    fn(acc, x, out=acc)
            elif how == 0:
                value[()] = fn(parts)
            else:
                fn(parts, out=value)
        return True

    def _exchange(self, values) -> bool:
        """Number the step, exchange the header slots (with ``values`` where they travel
        there): whether every node's head and blob is this node's."""
        comm = self.comm
        self.number[0] = comm.plan_step(self.mark, self.words)  # numbered before anything can fail
        for view, v in zip(self.sends, values):
            view[...] = v
        req = self.mpi_comm.Iallgather(*self.spec)
        own = self.own.tobytes()  # (meanwhile: MPI only reads the send slot)
        try:  # (the answer is usually there within a few tests: no wait set up for it)
            done = req.Test() or req.Test() or req.Test() or req.Test()
        except BaseException:  # noqa: BLE001 - the wait below meets it again, and abandons the step
            done = False
        if not done:
            comm.wait([req], "all_reduce", self.keep, header=True)
        for head in self.heads:
            if head.tobytes() != own:
                comm.plan_exchanged(False)
                return False
        comm.plan_exchanged(True)
        return True

    def _read_long(self, values) -> None:
        """The slots differ: read them as the full path does, then reduce or raise as it would."""
        self.comm.settle_slots("all_reduce", values, self.slots, self.blob, self.op)


class LargePlan(StepPlan):
    """A kept all-reduce among node masters of nodes of one process whose values do not
    travel in the header: the header exchange as :class:`StepPlan` makes it (with the
    full path's header, its values left out), then a ring of its own from the values
    straight into ``outs`` (spare arrays the engine gives and then swaps in): no copy.
    Only for dtypes MPI reduces in their own bytes (so the full path's reduction and
    this one agree on what a value is).

    The ring (reduce-scatter, then all-gather, ``Isend``/``Irecv`` of one segment per
    array to the next node): each node sends and receives ``2 (n - 1) / n`` of the
    bytes and reduces ``1 / n`` of them. Open MPI's ``Iallreduce`` takes a binomial tree
    below 4 ranks (the whole buffer to rank 0 and back), which made a 64 MiB step
    1.2-1.4x a blocking ``Allreduce`` on 2 nodes; the ring measured 0.6-0.8x (design-48
    §2). Its own, not Open MPI's ring through an MCA setting: that setting is global to
    the process and ignores whether a user's own op commutes. Every segment is reduced
    on one node and then sent to the others, so every node gets the same bits; with 2
    nodes in node order, as :func:`.ops.combine` (bit for bit); with more, in the
    ring's order (a float sum may differ from ``combine``'s in its last bits, as an
    ``Iallreduce``'s did).
    """

    out_of_place = True
    needs_exclusive = False

    @classmethod
    def make(cls, comm, lines, layout, op: str, step):
        """The plan, or None where MPI cannot reduce a dtype in its own bytes (see
        :meth:`StepPlan.make`)."""
        for dtype, shape in layout:
            plan = reduce_plan(dtype, op)
            if plan is None or plan[0].itemsize != dtype.itemsize or (plan[0] != dtype and dtype.kind != "b"):
                return None
        meta = (layout, 1.0, False, False)
        blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        if HEAD.size + len(blob) > HEADER_SLOT:
            return None
        return cls(comm, lines, layout, op, step, meta, blob)

    def run(self, values, outs=None) -> bool:
        comm = self.comm
        if comm.pre_begun or outs is None or len(values) != len(self.layout) or len(outs) != len(values):
            return False
        for v, o, (dtype, shape) in zip(values, outs, self.layout):
            for a in (v, o):
                if type(a) is not np.ndarray or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous \
                        or not a.flags.writeable:
                    return False
            if v.dtype is not dtype or np.may_share_memory(v, o):
                return False
        if not self._exchange(()):
            self._read_long(values)
            for v, o in zip(values, outs):
                np.copyto(o, v)
            return True
        self._ring([v.reshape(-1) for v in values], [o.reshape(-1) for o in outs])
        if self.op == "avg":  # (equal weights: the sum times the reciprocal of the count, as the full path)
            for o in outs:
                o *= o.dtype.type(1.0 / comm.size)
        return True

    def _ring(self, values, outs) -> None:
        """The ring over the flat ``values`` into the flat ``outs`` (see the class): node
        ``r`` ends the reduce-scatter with segment ``r`` of every array, then passes
        the reduced segments on until every node has every one."""
        comm, fold = self.comm, REDUCE_OPS[self.op]
        n, r = comm.size, comm.rank
        if n == 1:
            for v, o in zip(values, outs):
                np.copyto(o, v)
            return
        bounds = [[v.size * k // n for k in range(n + 1)] for v in values]

        def seg(flats, i, k):  # segment k of array i
            return flats[i][bounds[i][k]:bounds[i][k + 1]]

        own_first = r < (r - 1) % n  # (the received part is the left node's: node order where it can be)
        for s in range(n - 1):  # reduce-scatter: receive segment k from the left, fold this node's into it
            k, out = (r - s - 2) % n, (r - s - 1) % n
            self._step([seg(values if s == 0 else outs, i, out) for i in range(len(values))],
                       [seg(outs, i, k) for i in range(len(values))], (values, outs))
            for i in range(len(values)):
                got, mine = seg(outs, i, k), seg(values, i, k)
                fold(mine, got, out=got) if own_first else fold(got, mine, out=got)
        for s in range(n - 1):  # all-gather: pass on the reduced segments
            k, out = (r - s - 1) % n, (r - s) % n
            self._step([seg(outs, i, out) for i in range(len(values))],
                       [seg(outs, i, k) for i in range(len(values))], (values, outs))

    def _step(self, sends, recvs, keep) -> None:
        """One step of the ring: every segment of ``sends`` to the right node, every one
        of ``recvs`` from the left one (in pieces), never a blocking wait."""
        comm, mpi_comm, BYTE = self.comm, self.mpi_comm, self.MPI.BYTE
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

        def start():
            reqs = []
            for send, recv in zip(sends, recvs):
                if recv.size:  # (a segment of no elements is none on both sides)
                    reqs += [mpi_comm.Irecv([p, BYTE], left, RING_TAG) for p in pieces(recv.view(np.uint8))]
                if send.size:
                    reqs += [mpi_comm.Isend([p, BYTE], right, RING_TAG) for p in pieces(send.view(np.uint8))]
            return reqs

        comm.wait(comm.started("all_reduce", start), "all_reduce", keep)
