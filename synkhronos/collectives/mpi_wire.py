"""What the MPI communicator's messages carry: the header slot every node posts for
a step (its size, the step's number and checksum, the reduce plan; packed and read
here), the codes of its words, the reduce plans of dtypes and ops and the results
of reductions, a gather's parts as received (:class:`GatherParts`), large messages
in pieces (Open MPI's wheel speaks MPI 3.1: no message over 2**31 - 1 bytes), and the ring of every all-reduce's values
(:func:`ring_all_reduce`)."""

from __future__ import annotations

import pickle
import struct
import typing
import zlib
from typing import NamedTuple

import numpy as np

from .._arrays import packed_views, round_up
from ..errors import PeerFailed
from .ops import cast_to, combine, fold_ufunc, result_dtype

__all__: list = []

#: Seconds a wait polls MPI with only a yield in between, before it sleeps:
#: MPI progresses only inside its calls, so a large transfer wants them often
#: (a 64 MiB all-reduce took about 1.4x as long with 0.02 s, sleeping 100 us
#: between polls for most of it); Open MPI's own blocking calls spin throughout.
SPIN_SECONDS = 0.25
#: Tests of a wait's requests before its first yield of the core (about 0.3 ms): a
#: yield on a busy machine can cost a whole time slice, while a small exchange's
#: answer is usually a few microseconds away (one Test is about 0.3 us).
FIRST_TESTS = 1000
#: Sleep between polls once the spin is over (seconds), doubling up to POLL_SLEEP_MAX:
#: a wait that has spun 0.25 s waits for a node that is not there yet (a transfer
#: under way completes within the spin), so a millisecond more to notice costs
#: nothing, while 10,000 polls a second cost a waiting node about 12 % of a core
#: (a 5 s wait took 0.83 s of CPU; 0.38 s with the doubling).
POLL_SLEEP = 100e-6
POLL_SLEEP_MAX = 1e-3
#: Bytes of each node's header slot in the agreement all-gather; a larger
#: header (very many arrays) takes a second, variable-sized round.
HEADER_SLOT = 512
#: The head of each node's header slot (version 2, 40 bytes): its blob's length, its step's
#: number and key checksum (or a mark: JOINED, LEFT, FAILED), the blob's fingerprint, and what
#: exchange follows (see WHATS): its code, the op's code, padding, the root. The blob (the
#: pickled ``(layout, weight, flag, has_payload)``) follows the head; a small reduction's
#: payload follows the blob at :func:`payload_at`. Read it through :class:`Head`.
HEAD = struct.Struct("<qqqqbbhi")
#: Values (a reduction's, a broadcast's, a gather's parts) of at most this many bytes
#: per node travel inside the agreement, where they fit in the slot after the head and
#: the blob (one MPI exchange instead of two; a reduction's are combined on every node).
#: The slot is the bound: a gather's parts with their pickled layout (a call's gather
#: output of 8 rows of 4 float64: 80 + 256 bytes) fit where 256 bytes did not.
INLINE_BYTES = HEADER_SLOT - HEAD.size


class Head(NamedTuple):
    """One node's head, as :data:`HEAD` packs it (read every field by name)."""

    length: int       #: bytes of the blob
    number: int       #: the step's number
    mark: int         #: the step key's checksum, or JOINED, LEFT, FAILED
    fingerprint: int  #: zlib.crc32 of the blob
    what: int         #: the exchange that follows (an index in WHATS)
    op: int           #: the op (an index in OPS)
    pad: int          #: zero
    root: int         #: the root (-1: none), or a joined node's count of exchanges served


def payload_at(blob_length: int) -> int:
    """Where in a header slot the payload of a blob of ``blob_length`` bytes starts."""
    return (HEAD.size + blob_length + 7) & ~7
#: What a node's header says follows it (a node that has joined mirrors it): the
#: exchange, by its index here, then the op's index in OPS and the root (-1: none).
WHATS = ("", "all_reduce", "reduce", "all_gather", "gather", "broadcast", "barrier", "close")
OPS = (None, "sum", "avg", "prod", "max", "min")
WHAT_CODES = {w: i for i, w in enumerate(WHATS)}
OP_CODES = {op: i for i, op in enumerate(OPS)}
#: Bytes of a step's words (see MpiCommunicator.begin) that travel when steps differ.
STEP_TEXT = 96
#: The step checksum in the header of a node that has joined (see MpiCommunicator.join):
#: crc32 checksums are never negative.
JOINED = -1
#: The step checksum in the last header of a node that left after a failure (see
#: MpiCommunicator.leave).
LEFT = -2
#: The step checksum of a node whose step failed in its own checks before it knew its
#: key (see MpiCommunicator.fail_step): it matches any step of the same number.
FAILED = -3
#: Largest failure notice (bytes); longer reasons are cut.
NOTICE_BYTES = 2048

#: Largest piece of one MPI call (bytes). MPI 3.1 (what the Open MPI 5 wheel speaks)
#: counts elements and displacements in C ints: a message over 2**31 - 1 bytes (or
#: elements) fails with MPI_ERR_ARG. Every transfer larger than this goes in pieces
#: of at most this size, each its own non-blocking request (broadcast and reductions
#: piece by piece; gathers whose total passes it, node by node and piece by piece).
PIECE_BYTES = 1 << 30
#: The tag of a gather's point-to-point pieces on the data communicator.
PIECE_TAG = 7
#: The tag of :func:`ring_all_reduce`'s segments, the data communicator's only other
#: point-to-point messages.
RING_TAG = 8

#: reduce op -> MPI op name ("avg" is a weighted sum).
MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def reduce_plan(dtype, op: str):
    """How MPI reduces ``dtype`` with ``op``: ``(work dtype, MPI op name)``, or
    None when MPI cannot (then the bytes are gathered and combined with
    :func:`.ops.combine`, which gives the same results).

    ``avg`` of integers and booleans sums in float64; booleans travel as
    uint8, ``sum``/``max`` a logical or (MAX), ``prod``/``min`` a logical and
    (MIN); complex numbers sum, average and multiply in MPI, their
    ``max``/``min`` (numpy's order) are combined locally, as are float16 and
    long doubles.
    """
    dtype = np.dtype(dtype)
    if op == "avg" and dtype.kind in "biu":
        return np.dtype(np.float64), "SUM"
    if dtype.kind == "b":
        return np.dtype(np.uint8), "MAX" if op in ("sum", "max") else "MIN"
    if dtype.kind in "iu" and dtype.itemsize in (1, 2, 4, 8):
        return dtype.newbyteorder("="), MPI_OPS[op]
    if dtype.kind == "f" and dtype.itemsize in (4, 8):
        return dtype.newbyteorder("="), MPI_OPS[op]
    if dtype.kind == "c" and dtype.itemsize in (8, 16) and op in ("sum", "avg", "prod"):
        return dtype.newbyteorder("="), MPI_OPS[op]
    return None


def avg_scales(weights, mine):
    """``(pre, post)`` as :func:`.ops.combine` weighs an ``avg``: equal weights sum,
    then multiply by the reciprocal of the count (``pre`` None); uneven weights
    multiply each contribution by its share of the total (``post`` None)."""
    w = [float(x) for x in weights]
    total = sum(w)
    if total <= 0 or all(x == w[0] for x in w):
        return None, 1.0 / len(w)
    return float(mine) / total, None


def fit_into(into, layout, op):
    """``into`` (arrays to receive an all-reduce's results) where MPI can write
    each result there directly: C-contiguous, writeable, of the work dtype and
    the shape; None entries elsewhere (those are copied in afterwards). None
    when ``into`` is None."""
    if into is None:
        return None
    out = []
    for a, (dtype, shape) in zip(into, layout):
        plan = reduce_plan(dtype, op)
        ok = (plan is not None and isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
              and a.dtype == plan[0] and a.shape == tuple(shape))
        out.append(a if ok else None)
    return out


def spans(count: int, itemsize: int = 1):
    """``(lo, hi)`` element ranges of at most ``PIECE_BYTES`` each (at least one element)."""
    step = max(1, PIECE_BYTES // itemsize)
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)] or [(0, 0)]


def pieces(flat: np.ndarray):
    """Views of the 1-d contiguous ``flat`` of at most ``PIECE_BYTES`` each."""
    return [flat[lo:hi] for lo, hi in spans(flat.size, flat.itemsize)]


def as_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` in C order (a view when ``a`` is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def inline_reduce(arrays, layout, payloads, op, present, weights, in_place):
    """A reduction whose every part came inside the agreement, combined here
    as :func:`.ops.combine` does (every node the same, in node order)."""
    out = []
    for i, (dtype, shape) in enumerate(layout):
        parts = [payloads[r][i] for r in present]  # (views of the received slots)
        out.append(np.asarray(combine(parts, op, weights)))
    if in_place and arrays is not None:
        for a, res in zip(arrays, out):
            np.copyto(a, cast_to(res, a.dtype))
        return arrays
    return out


def finish_reduce(arrays, layout, jobs, op, present, weights, post, in_place):
    """The results of a reduction whose requests completed, in their result dtypes."""
    out = []
    for (dtype, shape), (kind, val) in zip(layout, jobs):
        rdtype = result_dtype(dtype, op)
        if kind == "empty":
            out.append(np.empty(shape, dtype=rdtype))
        elif kind == "local":
            parts = [val[r] for r in present]
            out.append(np.asarray(combine(parts, op, weights)))
        else:
            if post is not None:
                val *= val.dtype.type(post)
            out.append(val.view(rdtype) if val.dtype.kind == "u" and rdtype.kind == "b"
                       else val.astype(rdtype, copy=False))
    if in_place and arrays is not None:
        for a, res in zip(arrays, out):
            if not np.shares_memory(a, res):
                np.copyto(a, cast_to(res, a.dtype))
        return arrays
    return out


# -- the header slot ---------------------------------------------------------


#: Whether a communicator's header exchange is a persistent all-gather where the MPI
#: library has them (MPI-4: Open MPI 5, MPICH 4); tests set False to run the other route,
#: an ``Iallgather`` per exchange, as with Open MPI 4 or MPICH 3.
PERSISTENT_HEADERS = True


class HeaderExchange:
    """The exchange of header slots every step of a communicator starts with: its send
    slot and every node's receive slot, kept for the communicator's life, and the one
    all-gather between them. With an MPI-4 library it is a persistent request, made once
    (``Allgather_init``, collective: every node makes it when the communicator is made,
    before any other collective on it) and started at every exchange: MPI keeps its
    schedule, and a 4-byte step over 2 nodes of this machine took 2.3 us in a
    ``Start``/``Test`` loop against 5.1 us for an ``Iallgather`` made per step (mpi4py's
    blocking ``Allreduce``: 2.4 us). Without ``Allgather_init``, each exchange makes its
    ``Iallgather`` on the same buffers.

    Whatever reads :attr:`recv` reads it before the next exchange starts (the payload
    views a step reduces are read in that step). An exchange never completed (a wait
    abandoned: the communicator is then broken; a last header posted by ``leave()``)
    may still be under way in MPI: :meth:`release` keeps its request and buffers for
    the process's life then (``keep``), and frees the request otherwise."""

    __slots__ = ("send", "recv", "_comm", "_spec", "_persistent")

    def __init__(self, MPI, comm, size: int, keep: list):
        self.send = np.zeros(HEADER_SLOT, dtype=np.uint8)
        self.recv = np.zeros((size, HEADER_SLOT), dtype=np.uint8)
        self._comm = comm
        self._spec = ([self.send, MPI.BYTE], [self.recv, MPI.BYTE])
        try:
            if not PERSISTENT_HEADERS:
                raise NotImplementedError
            self._persistent = comm.Allgather_init(*self._spec)
        except (NotImplementedError, MPI.Exception):  # an MPI library older than MPI-4
            self._persistent = None
        else:  # (kept from here on: never freed by the collector while MPI may use it)
            keep.append((self._persistent, (self.send, self.recv)))

    @property
    def persistent(self) -> bool:
        """Whether the exchange is a persistent request (else an ``Iallgather`` each time)."""
        return self._persistent is not None

    def start(self):
        """Start the exchange of :attr:`send` into :attr:`recv`: its request."""
        req = self._persistent
        if req is None:
            return self._comm.Iallgather(*self._spec)
        req.Start()
        return req

    def release(self, keep: list) -> None:
        """At the communicator's close, before its MPI communicator is freed: free the
        persistent request if it is not under way, else leave it in ``keep``."""
        req, self._persistent = self._persistent, None
        if req is None:
            return
        try:
            if req.Test():  # (an exchange ended, or never started: inactive, free to free)
                req.Free()
                keep[:] = [k for k in keep if k[0] is not req]
        except Exception:  # noqa: BLE001 - an MPI error after a failure: left in keep
            pass


def fill_slot(slot, number: int, blob: bytes, mark: int, plan=(0, 0, -1), payload=None) -> None:
    """A node's header slot: its head (the blob's length, its step's ``number``, ``mark``,
    the blob's fingerprint and ``plan``: what, op, root), then ``blob`` when it fits, then
    ``payload`` (arrays' bytes, each on an 8-byte boundary) from :func:`payload_at`."""
    what, op, root = plan
    # (numpy < 2.5's stubs make an ndarray a Buffer on Python 3.12+ only)
    HEAD.pack_into(slot, 0, len(blob), number, mark, zlib.crc32(blob),  # type: ignore[arg-type, unused-ignore]
                   what, op, 0, root)
    if len(blob) <= HEADER_SLOT - HEAD.size:
        slot[HEAD.size:HEAD.size + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    if payload is not None:
        at = payload_at(len(blob))
        for a in payload:
            slot[at:at + a.nbytes] = as_bytes(a)
            at = round_up(at + a.nbytes, 8)


def payload_fits(arrays, blob_length: int) -> bool:
    """Whether ``arrays`` travel in the header slot after a blob of ``blob_length`` bytes."""
    if sum(a.nbytes for a in arrays) > INLINE_BYTES or any(a.dtype.hasobject for a in arrays):
        return False
    end = payload_at(blob_length)
    for a in arrays:
        end = round_up(end + a.nbytes, 8)
    return end <= HEADER_SLOT


def read_equal(slots, rank: int, blob: bytes, meta):
    """``(heads, metas)`` of every node, as node ``rank`` reads them from ``slots``, when
    every node's head and blob are byte for byte that node's (the same step number and
    key, layouts, weight, flag, what, op and root) and none left: every meta is ``meta``
    (nothing is unpickled), its payloads views of the slots. Else None."""
    n = HEAD.size + len(blob)
    if n > HEADER_SLOT:
        return None
    own = slots[rank, :n].tobytes()
    if not all(r == rank or slots[r, :n].tobytes() == own for r in range(len(slots))):
        return None
    head = Head._make(HEAD.unpack_from(slots[rank]))
    if head.mark == LEFT:
        return None
    layout, weight, flag, has_payload = meta
    at = payload_at(len(blob))
    return [head] * len(slots), [(layout, weight, flag, packed_views(slot, layout, at, 8) if has_payload else None)
                                 for slot in slots]


def read_meta(slot, blob: bytes, length: int):
    """A node's meta from its ``blob`` (``length`` bytes, as its head says) and its
    ``slot``: ``(layout, weight, flag, payload views of the slot or None)``."""
    layout, weight, flag, has_payload = pickle.loads(blob)
    return layout, weight, flag, packed_views(slot, layout, payload_at(length), 8) if has_payload else None


def left_reason(slot, length: int) -> str:
    """The reason in the last header of a node that left (see MpiCommunicator.leave)."""
    try:
        return pickle.loads(slot[HEAD.size:HEAD.size + length].tobytes())[2]
    except Exception:  # noqa: BLE001
        return "(unreadable)"


def no_failure(what: str, metas) -> None:
    """PeerFailed (every node) when a node flagged a failure; TypeError for object arrays."""
    for m in metas:
        if m[2]:
            failed_nodes = [r for r, m in enumerate(metas) if m[2]]
            reasons = "; ".join(f"node {r}: {metas[r][2]}" for r in failed_nodes
                                if isinstance(metas[r][2], str))
            raise PeerFailed(f"{what}: node(s) {failed_nodes} flagged a failure"
                             f"{' (' + reasons + ')' if reasons else ''}; nothing was combined")
    for r, m in enumerate(metas):
        for dtype, _ in m[0] or ():
            if dtype.hasobject:
                raise TypeError(f"{what}: node {r} gave an array of dtype {dtype}; MPI moves "
                                "arrays of numbers and booleans only")


class GatherParts:
    """The parts over nodes of one gathered array (see ``MpiCommunicator._start_gather``):
    ``parts[r]``, node ``r``'s, read where it was received (None where absent), once the
    gather completed."""

    __slots__ = ("lays", "sizes", "displs", "recv")

    def __init__(self, lays, sizes, displs, recv):
        self.lays, self.sizes, self.displs, self.recv = lays, sizes, displs, recv

    def __getitem__(self, r):
        lay = self.lays[r]
        if lay is None:
            return None
        dtype, shape = lay
        if self.sizes[r] == 0:
            return np.empty(shape, dtype=dtype)
        at = self.displs[r]
        return typing.cast(np.ndarray, self.recv)[at:at + self.sizes[r]].view(dtype).reshape(shape)


def gathered_inline(payloads, n: int, join):
    """A gather whose every node's ``n`` arrays travelled in its header (``payloads``: per
    node, views of its received slot, None where it gave none): per array, the parts over
    nodes, copied (the slots serve the next exchange), or ``join(i, parts)``."""
    out = []
    for i in range(n):
        parts = [None if p is None else np.array(p[i], copy=True) for p in payloads]
        out.append(parts if join is None else join(i, parts))
    return out


def gather_in_pieces(comm, MPI, send, recv, sizes, displs, root):
    """A gather too large for one MPI call, on the mpi4py communicator ``comm``: for an
    all-gather, each node broadcasts its part piece by piece; for a gather, each node
    sends its pieces to ``root`` (non-overtaking: they arrive in order). Requests, in
    the same order on every node."""
    rank, reqs = comm.Get_rank(), []
    if recv is not None and sizes[rank]:  # this node's own part, in place
        recv[displs[rank]:displs[rank] + sizes[rank]] = send
    for r in range(len(sizes)):
        if not sizes[r]:
            continue
        if root is None:
            part = recv[displs[r]:displs[r] + sizes[r]]
            reqs += [comm.Ibcast([p, MPI.BYTE], r) for p in pieces(part)]
        elif r == root:
            continue
        elif rank == root:
            part = recv[displs[r]:displs[r] + sizes[r]]
            reqs += [comm.Irecv([p, MPI.BYTE], r, PIECE_TAG) for p in pieces(part)]
        elif rank == r:
            reqs += [comm.Isend([p, MPI.BYTE], root, PIECE_TAG) for p in pieces(send)]
    return reqs


def plannable_layout(layout, op: str):
    """``layout`` (``(dtype, shape)`` per array) as a kept plan holds it, when every array
    is of numbers or booleans whose ``op`` result keeps its dtype (no ``avg`` of
    integers); None otherwise."""
    lay = []
    for dtype, shape in layout:
        if not isinstance(dtype, np.dtype) or dtype.kind not in "biufc" or not isinstance(shape, tuple) \
                or result_dtype(dtype, op) != dtype:
            return None
        lay.append((dtype, tuple(int(d) for d in shape)))
    return lay


def step_text(text: str) -> np.ndarray:
    """``text`` as a step's words travel after a mismatch: :data:`STEP_TEXT` bytes, cut
    and padded with zeros."""
    out = np.zeros(STEP_TEXT, dtype=np.uint8)
    raw = text.encode()[:STEP_TEXT]
    out[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def steps_differ(heads) -> bool:
    """Whether the nodes of ``heads`` (:class:`Head`) that have not joined are in different
    steps; a node whose step failed before it knew its key (FAILED) matches any step of its
    number. (Plain loops first: this runs at every exchange, and almost always finds every
    node in the same step.)"""
    number, mark = heads[0].number, heads[0].mark
    for h in heads:
        if h.number != number or h.mark != mark:
            break
    else:
        return False
    active = [h for h in heads if h.mark != JOINED]  # (a joined node's head differs)
    return len({h.number for h in active}) > 1 or len({h.mark for h in active if h.mark != FAILED}) > 1


#: Nodes among which an all-reduce goes by :func:`ring_all_reduce` (else by
#: :func:`ordered_reduce`): with 2 the ring folds in node order, bit for bit
#: :func:`.ops.combine`; with 3 its order differs, and a weighted integer avg rounded
#: differently (seen).
RING_NODES = 2

#: MPI op name (reduce_plan's) -> the ufunc a reduction among nodes folds with
#: (:func:`fold_reduce`), on the work dtype (booleans travel as uint8: MAX an or, MIN an and).
RING_FOLDS = {"SUM": np.add, "PROD": np.multiply, "MAX": np.maximum, "MIN": np.minimum}


def ring_fold(work, name: str):
    """What a reduction among nodes folds with: ``RING_FOLDS[name]`` on the work dtype
    (:func:`reduce_plan`'s pair), a complex ``PROD`` :func:`.ops.fold_ufunc`'s (never
    written over an operand: the bits of every other path)."""
    if name == "PROD" and work.kind == "c":
        return fold_ufunc("prod", work)
    return RING_FOLDS[name]


def ring_all_reduce(comm, lines, sends, recvs, folds, keep, what: str = "all_reduce") -> None:
    """All-reduce the flat arrays ``sends`` into the flat ``recvs`` (another array each,
    of the same dtype and size on every node) with ``folds`` (a ufunc per array), by a
    ring: reduce-scatter, then all-gather, ``Isend``/``Irecv`` of one segment per array
    to the next node in each step, in pieces, every step through ``comm.started`` and
    ``comm.wait`` (never a blocking wait; a failure or a notice abandons it as any wait).

    Each node sends and receives ``2 (n - 1) / n`` of the bytes and folds ``1 / n`` of
    them. Open MPI's ``Iallreduce`` takes a binomial tree below 4 ranks (the whole buffer
    to rank 0 and back): 1.0-1.6x a blocking ``Allreduce`` of 64 MiB on 2 nodes, the ring
    0.3-0.9x. Every segment is folded on one node and passed on, so every node gets the
    same bits; with 2 nodes in node order (as :func:`.ops.combine`, bit for bit), with
    more in the ring's order. ``lines``: ``(MPI module, mpi4py communicator)``; ``comm``
    the :class:`.mpi.MpiCommunicator` (its ``rank`` and ``size`` are the communicator's)."""
    n, r = comm.size, comm.rank
    if n == 1:
        for send, recv in zip(sends, recvs):
            np.copyto(recv, send)
        return
    bounds = [[a.size * k // n for k in range(n + 1)] for a in sends]

    def seg(flats, i, k):  # segment k of array i
        return flats[i][bounds[i][k]:bounds[i][k + 1]]

    count = range(len(sends))
    own_first = r < (r - 1) % n  # (the received part is the left node's: node order where it can be)
    for s in range(n - 1):  # reduce-scatter: receive segment k from the left, fold this node's into it
        k, out = (r - s - 2) % n, (r - s - 1) % n
        _ring_step(comm, lines, [seg(sends if s == 0 else recvs, i, out) for i in count],
                   [seg(recvs, i, k) for i in count], keep, what)
        for i, fold in zip(count, folds):
            got, mine = seg(recvs, i, k), seg(sends, i, k)
            fold(mine, got, out=got) if own_first else fold(got, mine, out=got)
    for s in range(n - 1):  # all-gather: pass the folded segments on
        k, out = (r - s - 1) % n, (r - s) % n
        _ring_step(comm, lines, [seg(recvs, i, out) for i in count], [seg(recvs, i, k) for i in count], keep, what)


def fold_reduce(comm, lines, sends, recvs, folds, keep, what: str = "all_reduce", root=None) -> None:
    """Every reduction MPI's bytes carry: the ring (:func:`ring_all_reduce`) for an
    all-reduce on 2 nodes, else :func:`ordered_reduce`; both fold in node order, with
    numpy's ufuncs, as :func:`.ops.combine` does. (MPI's own ``Iallreduce`` and ``Ireduce``
    were used on 3 nodes or more and for a reduce to a root: Open MPI folds from 4 ranks
    on in another order, and its MAX and MIN dropped a NaN that numpy's keep: a float
    ``max`` across 3 nodes returned a number where every other path returns NaN.)"""
    if root is None and comm.size == RING_NODES:
        ring_all_reduce(comm, lines, sends, recvs, folds, keep, what)
    else:
        ordered_reduce(comm, lines, sends, recvs, folds, keep, what, root)


def ordered_reduce(comm, lines, sends, recvs, folds, keep, what: str = "all_reduce", root=None) -> None:
    """Reduce the flat arrays ``sends`` (of one dtype and size per array on every node)
    with ``folds`` (a ufunc per array) in node order into the flat ``recvs``, on every
    node (``root`` None) or on node ``root`` (the others' ``recvs`` may be None): each
    node receives its segment of every array from every node (``Ialltoallv``), folds
    the segments in node order (``fold(acc, next, out=acc)``, bit for bit
    :func:`.ops.combine`), and the folded segments are all-gathered (``Iallgatherv``;
    ``Igatherv`` to ``root``). Each node sends and receives ``2 (n - 1) / n`` of the
    bytes, as in a ring, in pieces of at most PIECE_BYTES, every step through
    ``comm.started`` and ``comm.wait`` as the ring's."""
    MPI, mpi_comm = lines
    n, r = comm.size, comm.rank
    jobs = []  # per piece: (fold, its sends, its recvs or None, segment bounds, every node's segment)
    for send, recv, fold in zip(sends, recvs, folds):
        for lo, hi in spans(send.size, send.itemsize):
            bounds = [(hi - lo) * k // n for k in range(n + 1)]
            parts = np.empty((n, bounds[r + 1] - bounds[r]), dtype=send.dtype)
            jobs.append((fold, send[lo:hi], None if recv is None else recv[lo:hi], bounds, parts))
    keep.append(jobs)  # (mpi4py keeps none of the buffers it is given)

    def layout(bounds, size):  # byte counts and displacements of the segments
        return [(bounds[k + 1] - bounds[k]) * size for k in range(n)], [b * size for b in bounds[:n]]

    def exchange():
        reqs = []
        for _, send, _, bounds, parts in jobs:
            row = parts.shape[1] * send.itemsize  # (this node's segment, from each node)
            received = ([row] * n, [k * row for k in range(n)])
            reqs.append(mpi_comm.Ialltoallv([send.view(np.uint8), layout(bounds, send.itemsize), MPI.BYTE],
                                            [parts.view(np.uint8), received, MPI.BYTE]))
        return reqs

    comm.wait(comm.started(what, exchange), what, keep)
    for fold, _, _, _, parts in jobs:
        acc = parts[0]
        for k in range(1, n):
            fold(acc, parts[k], out=acc)

    def gather():
        reqs = []
        for _, send, recv, bounds, parts in jobs:
            mine = [parts[0].view(np.uint8), MPI.BYTE]
            into = None if recv is None else [recv.view(np.uint8), layout(bounds, send.itemsize), MPI.BYTE]
            reqs.append(mpi_comm.Iallgatherv(mine, into) if root is None else mpi_comm.Igatherv(mine, into, root))
        return reqs

    comm.wait(comm.started(what, gather), what, keep)


def _ring_step(comm, lines, sends, recvs, keep, what) -> None:
    """One step of :func:`ring_all_reduce`: every segment of ``sends`` to the right node,
    every one of ``recvs`` from the left one."""
    MPI, mpi_comm = lines
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def start():
        reqs = []
        for send, recv in zip(sends, recvs):
            if recv.size:  # (a segment of no elements is none on both sides)
                reqs += [mpi_comm.Irecv([p, MPI.BYTE], left, RING_TAG) for p in pieces(recv.view(np.uint8))]
            if send.size:
                reqs += [mpi_comm.Isend([p, MPI.BYTE], right, RING_TAG) for p in pieces(send.view(np.uint8))]
        return reqs

    comm.wait(comm.started(what, start), what, keep)
