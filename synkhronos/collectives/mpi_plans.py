"""The MPI communicator's kept all-reduce and broadcast plans among node masters of nodes of one process.

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
import typing
import zlib

import numpy as np

from .._arrays import packed_views, round_up
from .base import CommPlan
from .mpi_wire import (HEAD, HEADER_SLOT, INLINE_BYTES, MPI_OPS, OP_CODES, WHAT_CODES,
                       fill_slot, fold_reduce, payload_at, plannable_layout, reduce_plan, ring_fold)
from .ops import Reducer

__all__ = ["BroadcastPlan", "CallPlan", "LargePlan", "StepPlan"]

#: The step number's place in a header slot (see mpi_wire.HEAD: an int64 after the blob's length).
_NUMBER = 8


def _of_layout(arrays, layout, writable: bool = True) -> bool:
    """Whether ``arrays`` are numpy arrays of ``layout``'s dtypes and shapes (a dtype equal to
    the plan's but another object too: a value received unpickled), writable if asked."""
    for a, (dtype, shape) in zip(arrays, layout):
        if type(a) is not np.ndarray or (a.dtype is not dtype and a.dtype != dtype) or a.shape != shape \
                or (writable and not a.flags.writeable):
            return False
    return True


def _blob_with_payload(meta):
    """The full path's pickled ``meta`` (``(layout, weight, flag, True)``) of values that
    travel in the header slot after it, or None when they do not fit there."""
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    nbytes = [math.prod(shape) * dtype.itemsize for dtype, shape in meta[0]]
    end = payload_at(len(blob))
    for n in nbytes:
        end = round_up(end + n, 8)
    return None if sum(nbytes) > INLINE_BYTES or end > HEADER_SLOT else blob


class _SlotPlan(CommPlan):
    """What :class:`StepPlan` and :class:`CallPlan` share: the full path's header slot of
    one exchange, made once (:meth:`_make_slots`), and the exchange itself, through the
    communicator's :class:`.mpi_wire.HeaderExchange` as the full path's, compared byte
    for byte (:meth:`_exchange_slots`)."""

    comm: typing.Any  # the MpiCommunicator (set by each plan's __init__)

    def _make_slots(self, comm, lines, layout, op: str | None, blob: bytes, mark: int, payload: bool,
                    plan=None, others=None):
        """This plan's slot (head and ``blob`` written once: a run writes its step's number,
        and its values where ``payload``, then copies it into the header exchange's send
        slot), the exchange's receive slots, and this node's head and blob and every other
        node's, to compare: the same as this node's, or, for the nodes of ``others``
        (``(ranks, blob)``: a broadcast's root, or its other nodes), their own head with
        that blob. ``plan``: the head's what, op and root (default: an all_reduce by
        ``op``). Per node, the views of its values in its receive slot (``payload``), else None."""
        self.MPI, self.mpi_comm = lines
        self.fingerprint = zlib.crc32(blob)
        size, at = comm.size, payload_at(len(blob))
        self.header = comm.header  # (its buffers live as long as the communicator: so do these views)
        self.slot = np.zeros(HEADER_SLOT, dtype=np.uint8)
        self.slots = self.header.recv
        plan = (WHAT_CODES["all_reduce"], OP_CODES[op], -1) if plan is None else plan
        fill_slot(self.slot, 0, blob, mark, plan)
        self.number = self.slot[_NUMBER:_NUMBER + 8].view("<i8")
        n = HEAD.size + len(blob)
        self.own = self.slot[:n]  # this node's head and blob; every other node's, to compare
        ranks: list = []
        self.model = None  # (others: their head and blob; the number written per run, self.model_number)
        if others is not None:
            ranks, other_blob = others
            model = np.zeros(HEADER_SLOT, dtype=np.uint8)
            fill_slot(model, 0, other_blob, mark, plan)
            self.model, self.model_number = model[:HEAD.size + len(other_blob)], model[_NUMBER:_NUMBER + 8].view("<i8")
        self.heads = [self.slots[r, :n] for r in range(size) if r != comm.rank and r not in ranks]
        self.others = [] if self.model is None else [self.slots[r, :len(self.model)] for r in ranks]
        self.keep = (self.header.send, self.slots)
        self.sends: list = packed_views(self.slot, layout, at, 8) if payload else []
        return [packed_views(self.slots[r], layout, at, 8) for r in range(size)] if payload else None

    def _exchange_slots(self, values) -> bool:
        """Exchange the header slots (the step's number written, ``values`` written here
        where they travel there): whether every node's head and blob is the one this node
        expects (its own, or its model's for the nodes of ``others``)."""
        comm = self.comm
        for view, v in zip(self.sends, values):
            view[...] = v
        header = self.header
        header.send[...] = self.slot
        req = header.start()
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
        if self.model is not None:
            self.model_number[0] = self.number[0]
            model = self.model.tobytes()
            for head in self.others:
                if head.tobytes() != model:
                    comm.plan_exchanged(False)
                    return False
        comm.plan_exchanged(True)
        return True


class StepPlan(_SlotPlan):
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
    def make(cls, comm, lines, layout, op: str, step, weight: float = 1.0):
        """The plan, or None when the values do not travel in the header slot. ``comm``:
        the :class:`.mpi.MpiCommunicator`; ``lines``: its MPI module and mpi4py communicator;
        ``weight``: this node's in an ``avg``, as the full path's (a node of one process
        weighs 1, a node of several the sum of its processes' weights)."""
        meta = (layout, float(weight), False, True)
        blob = _blob_with_payload(meta)
        return None if blob is None else cls(comm, lines, layout, op, step, meta, blob)

    def __init__(self, comm, lines, layout, op: str, step, meta, blob: bytes):
        self.comm, self.layout, self.op, self.meta, self.blob = comm, layout, op, meta, blob
        self.key, self.words = step
        self.mark = comm.mark_of(self.key)  # the step key's checksum, as begin() gives it
        # (meta[3]: the values travel in the header slots)
        received = self._make_slots(comm, lines, layout, op, blob, self.mark, meta[3])
        size = comm.size
        self.folds = [] if received is None else [
            self._fold_of(Reducer(op, dtype, shape, None, size), [received[r][i] for r in range(size)])
            for i, (dtype, shape) in enumerate(layout)]
        self.count = len(layout)

    def _fold_of(self, reducer, parts):
        """``(how, reducer, parts)``: how every node's ``parts`` (views of the receive slots)
        combine into a value, with the operations of :func:`.ops.combine` in its order:
        0 as numpy scalars (:meth:`.ops.Reducer.scalar`), 1 a ufunc fold into the value,
        2 the reducer into the value."""
        if reducer.scalar_path:
            return 0, reducer.scalar, parts
        if self.op != "avg" and len(parts) > 1:  # (ops._fold, into the value)
            return 1, reducer.fold, parts
        return 2, reducer, parts

    def run(self, values, outs=None) -> bool:
        """The all-reduce into ``values`` in place, or into ``outs`` (arrays of the layout,
        not the values: a ``synk.reduce``'s results, the values left as they are)."""
        comm = self.comm
        if comm.pre_begun or len(values) != self.count or (outs is not None and len(outs) != self.count):
            return False
        into = values if outs is None else outs
        if not _of_layout(values, self.layout, outs is None) or (outs is not None and not _of_layout(outs, self.layout)):
            return False
        if not self._exchange(values):
            if outs is not None:  # (the long way reduces in place: into copies of the values)
                for v, out in zip(values, outs):
                    np.copyto(out, v)
            self._read_long(into)
            return True
        for value, (how, fn, parts) in zip(into, self.folds):
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
        self.number[0] = self.comm.plan_step(self.mark, self.words)  # numbered before anything can fail
        return self._exchange_slots(values)

    def _read_long(self, values) -> None:
        """The slots differ: read them as the full path does, then reduce or raise as it would."""
        self.comm.settle_slots("all_reduce", values, self.slots, self.blob, self.op)


class LargePlan(StepPlan):
    """A kept all-reduce among node masters of nodes of one process whose values do not
    travel in the header: the header exchange as :class:`StepPlan` makes it (with the
    full path's header, its values left out), then, as the full path,
    :func:`.mpi_wire.fold_reduce` (node order, bit for bit :func:`.ops.combine`: the ring
    on 2 nodes, where Open MPI's binomial ``Iallreduce`` below 4 ranks made a 64 MiB step
    1.0-1.6x a blocking ``Allreduce`` and the ring 0.3-0.9x; segments folded on their own
    nodes on more), from the values straight into ``outs`` (spare arrays the engine gives
    and then swaps in): no copy. Only for dtypes MPI reduces in their own bytes (so the full path's
    reduction and this one agree on what a value is).
    """

    out_of_place = True
    needs_exclusive = False

    @classmethod
    def make(cls, comm, lines, layout, op: str, step, weight: float = 1.0):
        """The plan, or None where MPI cannot reduce a dtype in its own bytes (see
        :meth:`StepPlan.make`), or for a node of several processes (``weight`` not 1)."""
        if weight != 1.0:
            return None
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
        folds = [ring_fold(*reduce_plan(dtype, self.op)) for dtype, _ in self.layout]  # (as the full path)
        fold_reduce(comm, (self.MPI, self.mpi_comm), [v.reshape(-1) for v in values], [o.reshape(-1) for o in outs],
                    folds, [values, outs])
        if self.op == "avg":  # (equal weights: the sum times the reciprocal of the count, as the full path)
            for o in outs:
                o *= o.dtype.type(1.0 / comm.size)
        return True


class CallPlan(_SlotPlan):
    """A planned call's output reduction among node masters of nodes of one process:
    the exchange the full path makes inside the call's step (``all_reduce`` of the
    outputs in their result dtypes with this node's ``weight``, every output of one op,
    small enough to travel in the header slot), its header slot made once. Each
    :meth:`run` writes the call step's number and key (numbered when the call began)
    and the outputs into it, makes the one exchange, and compares every node's head
    and blob with this node's, byte for byte: all equal (the same step, layout, op and
    weight everywhere), every node combines every node's outputs in node order with
    the full path's weights (:func:`.ops.combine`, so a node on the full path in the
    same step gets the same bits); any difference reads the slots as the full path
    does and reduces or raises as it would. Results are new arrays, never an output.
    """

    @classmethod
    def make(cls, comm, lines, layout, ops, weight: float):
        """The plan, or None: several ops, a gather, an ``avg`` of integers, no weight,
        or outputs that do not travel in the header slot."""
        ops = [ops] * len(layout) if isinstance(ops, str) else list(ops)
        if not ops or len(set(ops)) != 1 or len(ops) != len(layout) or not weight > 0:
            return None
        op = ops[0]
        lay = plannable_layout(layout, op) if op in MPI_OPS else None
        if lay is None:
            return None
        blob = _blob_with_payload((lay, float(weight), False, True))  # (the full path's meta of these outputs)
        return None if blob is None else cls(comm, lines, lay, op, float(weight), blob)

    def __init__(self, comm, lines, layout, op: str, weight: float, blob: bytes):
        self.comm, self.layout, self.op, self.weight, self.blob = comm, layout, op, weight, blob
        received = typing.cast(list, self._make_slots(comm, lines, layout, op, blob, 0, True))
        self.mark = self.slot[_NUMBER + 8:_NUMBER + 16].view("<i8")  # (the call step's key: written per run)
        size = comm.size
        weights = [weight] * size  # (all equal when every blob is this one: the full path's weights)
        self.folds = [(Reducer(op, dtype, shape, weights, size), [received[r][i] for r in range(size)])
                      for i, (dtype, shape) in enumerate(layout)]

    def run(self, values, outs=None) -> bool:
        """The reduced outputs into ``outs`` (a list, one new array per value); False,
        nothing sent, when the values left the plan or the step is not a call's."""
        comm = self.comm
        if comm.pre_begun or outs is None or len(values) != len(self.layout) or len(outs) != len(values):
            return False
        values = [np.asarray(v) for v in values]  # (as the full path takes them)
        for v, (dtype, shape) in zip(values, self.layout):
            if v.dtype != dtype or v.shape != shape or v.dtype.hasobject:
                return False
        comm.enter_exchange("all_reduce")
        self.number[0], self.mark[0] = comm.step  # (the call's step, numbered when it began)
        if self._exchange_slots(values):
            for i, (reducer, parts) in enumerate(self.folds):
                outs[i] = np.array(reducer(parts), copy=True)  # (never a view of the kept slots)
            return True
        got = [np.array(v, copy=True) for v in values]  # (the full path reads the slots long: into copies)
        comm.settle_slots("all_reduce", got, self.slots, self.blob, self.op)
        outs[:] = got
        return True


class BroadcastPlan(_SlotPlan):
    """A kept broadcast from node ``root`` among node masters of nodes of one process,
    of values that travel in the header slot: the full path's header of this node,
    made once (root's carries its layout and, per run, its values; every other node's
    says it gives none), and the one exchange. Each :meth:`run` numbers the step
    first, makes the exchange and compares every node's head and blob with the full
    path's of that node, byte for byte: all equal, every other node copies root's
    values into its own in place; any difference reads the slots as the full path
    reads them and then goes on (root's values, new arrays, into ``outs``) or raises,
    as the full path would. So a node on the full path (which sends root's values in
    its header where they fit) and nodes on their plans meet in the same step.
    """

    @classmethod
    def make(cls, comm, lines, layout, step, root: int):
        """The plan, or None where root's values would not travel in the header slot."""
        lay = []
        for dtype, shape in layout:
            if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(shape, tuple):
                return None
            lay.append((dtype, tuple(int(d) for d in shape)))
        blob = _blob_with_payload((lay, 1.0, False, True))  # (root's meta as the full path's _agree makes it)
        return None if blob is None else cls(comm, lines, lay, step, root, blob)

    def __init__(self, comm, lines, layout, step, root: int, blob: bytes):
        self.comm, self.layout, self.root = comm, layout, root
        self.key, self.words = step
        self.mark = comm.mark_of(self.key)
        self.is_root = comm.rank == root
        self.needs_exclusive = not self.is_root  # (the other nodes write root's values into theirs)
        none = pickle.dumps((None, 1.0, False, False), protocol=pickle.HIGHEST_PROTOCOL)
        self.blob = blob if self.is_root else none
        ranks = [r for r in range(comm.size) if r != root] if self.is_root else [root]
        self._make_slots(comm, lines, layout, None, self.blob, self.mark, self.is_root,
                         plan=(WHAT_CODES["broadcast"], OP_CODES[None], root),
                         others=(ranks, none if self.is_root else blob))
        self.received = packed_views(self.slots[root], layout, payload_at(len(blob)), 8)  # (root's values)
        self.count = len(layout)

    def run(self, values, outs=None) -> bool:
        """Root's values into ``values`` (in place; root: sends its own), or, after slots
        that differ, into ``outs`` (a list: root's values as new arrays, for the engine to
        place); False, nothing sent, when the values left the plan."""
        comm = self.comm
        if comm.pre_begun or len(values) != self.count or outs is None or len(outs) != self.count:
            return False
        if not _of_layout(values, self.layout, writable=not self.is_root):
            return False
        self.number[0] = comm.plan_step(self.mark, self.words, "broadcast")  # numbered before anything can fail
        if self._exchange_slots(values):
            if not self.is_root:
                for v, got in zip(values, self.received):
                    np.copyto(v, got)
            return True
        got = comm.settle_slots("broadcast", values, self.slots, self.blob, None, self.root)
        if not self.is_root:
            outs[:] = got
        return True
