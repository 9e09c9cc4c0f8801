"""MPI Communicator among the masters of several nodes, through mpi4py.

Under ``mpirun`` (or ``srun``) each launched copy of a script is the master of its node. The node's
processes reduce and gather among themselves first, through the shared-memory communicator (or NCCL);
then the node masters alone run one collective through this communicator; then each master shares the
result inside its node again (see :mod:`.hier`). So an ``MpiCommunicator`` lives only in node masters,
one per node, over an mpi4py communicator whose ranks are the node indices. Workers never touch MPI:
the node master forks them before MPI is initialised (``mpi4py.rc.initialize = False``, then
``MPI.Init_thread`` after the fork), and this module imports mpi4py only when a communicator is made.

Every collective first agrees, in one small non-blocking all-gather (a persistent one,
:class:`.mpi_wire.HeaderExchange`, started at each step), on what each node
contributes (dtypes and shapes, weights, failure flags): a node that flagged ``failed=True``
makes every node raise :class:`PeerFailed` before anything is combined, and different layouts
are the same ``ValueError`` on every node. Then the arrays move with buffer-based non-blocking
MPI calls (``Isend``/``Irecv``, ``Ialltoallv``, ``Ibcast``, ``Igatherv``, ``Iallgatherv``), never
pickled; reductions fold in node order with numpy's ufuncs (:func:`.mpi_wire.fold_reduce`, never
MPI's own reduction ops); a node with nothing to add sends the identity element of the op. Dtypes
and values follow :mod:`.ops` as on every other path: ``avg`` of integers or booleans is float64,
``sum``/``max`` of booleans is a logical or.

No call ever blocks inside MPI: every wait is a loop of ``Test()`` with
``check()`` (the runtime's liveness check: the node's workers, deadlines,
signals) between short sleeps. A blocking wait would be fatal twice over:
``mpirun`` stops a job with SIGTERM, and a process blocked in a C-level MPI
call never runs a Python handler; and a node whose worker died would wait
for ever for a collective its peers can no longer finish.

When a wait ends in an exception (``check()`` raised: a local worker died,
a deadline passed, a signal handler raised), this node sends a short notice
to every other node on a communicator of its own and raises. The others
are polling their own waits, see the notice within one poll and raise
:class:`NodeFailedError` naming the node and its reason (which names the
failed rank). Such a communicator is *broken*: the collective it abandoned
can never complete, so every later call raises and :meth:`close` only
releases what is local; ``synk.close()`` and ``synk.fork()`` make a new one.
A node master that dies outright is mpirun's to report: it stops the job by
sending SIGTERM to every process, which the polling lets Python handle.
"""

from __future__ import annotations

import functools
import math
import pickle
import zlib
from typing import Any, Callable

import numpy as np

from .. import _state as state
from .._protocol.control import WAIT_SLICE
from ..errors import NodeFailedError, PeerFailed, StepMismatchError, SynkError
from .._procs.launch import Notices, mpi as _mpi
from .._procs.waits import wait_until
from .base import Communicator
from . import mpi_wire
from .mpi_plans import BroadcastPlan, CallPlan, LargePlan, StepPlan
from .mpi_wire import (FAILED, FIRST_TESTS, HEAD, HEADER_SLOT, JOINED, LEFT, MPI_OPS, NOTICE_BYTES, OPS, OP_CODES,
                       POLL_SLEEP, POLL_SLEEP_MAX, SPIN_SECONDS, STEP_TEXT, WHATS, WHAT_CODES,
                       GatherParts, Head, HeaderExchange, as_bytes, avg_scales, fill_slot, finish_reduce, fit_into,
                       fold_reduce, gather_in_pieces, gathered_inline, inline_reduce, left_reason, no_failure,
                       payload_fits, pieces, plannable_layout, read_equal, read_meta, reduce_plan, ring_fold, step_text,
                       steps_differ)
from .ops import agreed_layout, identity

__all__ = ["MpiCommunicator", "NodeFailedError", "reduce_plan"]

class MpiCommunicator(Communicator):
    """Collectives over MPI among node masters, one per node.

    Args:
        comm: an mpi4py intra-communicator whose ranks are the node masters
            (``MPI.COMM_WORLD`` under ``mpirun`` with one copy per node). It is
            duplicated (collectively), so the caller's own traffic never
            mixes with this communicator's.
        master_rank: the rank in ``comm`` of the master node (node 0's master).
        check: called between wait slices; raises when this node cannot go on
            (a worker died, a deadline passed): the runtime's ``Session.check``.

    Raises:
        SynkError: MPI is not initialised, or already finalised.
        ValueError: ``master_rank`` is not a rank of ``comm``.

    Every node master must create it at the same time (duplicating ``comm``
    is collective). Arrays in and out are numpy arrays.
    """

    device_arrays = False
    supports_resident = False

    def __init__(self, comm, master_rank: int = 0, check: Callable[[], None] = lambda: None):
        MPI = _mpi()
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise SynkError("MPI is not initialised (or already finalised): the node master calls "
                            "MPI.Init_thread() after forking its workers, before making an "
                            "MpiCommunicator")
        size = comm.Get_size()
        if not isinstance(master_rank, (int, np.integer)) or not 0 <= master_rank < size:
            raise ValueError(f"master_rank must be a rank of the MPI communicator (0 to {size - 1}), "
                             f"got {master_rank!r}")
        self._MPI = MPI
        self.check = check
        self.broken: str | None = None
        self.rank = comm.Get_rank()
        self.size = size
        self.master_rank = int(master_rank)
        # the duplicate of comm (mpi4py) and the failure channel between nodes (launch.Notices):
        # None before they are made and once closed (every use follows enter's check, or is in a step)
        self._comm: Any = None
        self._notices: Any = None
        self.step = (0, 0)          # (number, key checksum) of this node's step: see begin()
        self.begun = 0              # steps begun here (a caller compares it to see whether it began one)
        self._exchanges = 0         # exchanges of headers in this step so far
        self.plan_steps = 0         # steps made by a kept plan (_StepPlan; tests read it)
        self._failed: str | None = None  # why this step failed on every node (known from an exchange), if it did
        self.pre_begun = False      # a step begun before its command (see nodes.from_first_node)
        self._words = "fork()"      # what this step is, in words
        self._crcs: dict = {}       # step key -> its checksum
        self.waiting: str | None = None  # what this node master waits for the other nodes in, if it does
        self.joined: list = []      # the nodes that had joined (join()) at the last exchange
        self.ended: str | None = None  # why no step can be made any more (a node left, the others closed)
        self._leaving = None        # this node's last header (leave()): (request, buffers)
        self._abandoned: list = []  # (requests, buffers) of waits given up: never freed
        self._recv: dict = {}       # (dtype, shape) -> receive buffer of in-place all-reduces
        # duplicates, without blocking, one at a time (two outstanding Idups hung in Open MPI 5 once an
        # abandoned exchange held a context id on one node only): data on one, failure notices on the
        # other. MPI pairs collectives in the order they start: duplicates an earlier try gave up
        # waiting for are the ones the other nodes' (next) try meets: waited for again, never new ones
        pending, state.mpi_pending_dup = state.mpi_pending_dup, None
        comm_dup, req, ctl_dup, req2 = pending[1:] if pending is not None and pending[0] is comm else \
            (*comm.Idup(), None, None)
        try:
            self.wait([req], "creating the MPI communicator", notices=False)
            if ctl_dup is None:
                ctl_dup, req2 = comm.Idup()
            self.wait([req2], "creating the MPI communicator", notices=False)
        except BaseException:
            state.mpi_pending_dup = (comm, comm_dup, req, ctl_dup, req2)
            raise
        for c in (comm_dup, ctl_dup):
            c.Set_errhandler(MPI.ERRORS_RETURN)  # MPI errors become exceptions, never an abort
        self._comm = comm_dup
        self._notices = Notices(ctl_dup, NOTICE_BYTES)
        #: every step's first exchange: the header slots (mpi_wire.HeaderExchange; collective, made here)
        self.header = HeaderExchange(MPI, comm_dup, size, state.mpi_leaving)

    # -- waiting and failures ----------------------------------------------

    def _peer_failed(self, what: str, in_header: bool = False):
        node, reason, *kind = self._notices.received(unreadable=("?", "(unreadable failure notice)"))
        if kind == ["left"]:  # it left at a step's end (see leave()): nothing was abandoned
            if self.ended is None:
                self.ended = f"node {node} left after a failure ({reason})"
                if not in_header:  # its last header waits for one of ours: the exchange it would meet
                    self._answer_leave()
            raise NodeFailedError(node, f"it left after a failure: {reason}", what)
        self.broken = self.broken or f"node {node} failed: {reason}"
        raise NodeFailedError(node, reason, what)

    def _answer_leave(self) -> None:
        """Post the header exchange that a node's last header (leave()) meets, without
        waiting: MPI completes it when that node next progresses (at its close(), at
        the latest in MPI_Finalize), so nothing is left outstanding."""
        state.mpi_leaving.append(self._post_header(b"", LEFT))

    def _post_header(self, blob: bytes, mark: int, plan=(0, 0, -1), payload=None):
        """Start the exchange of every node's header slot (see :func:`.mpi_wire.fill_slot`):
        ``(request, (slot, slots))``, the request and the buffers it uses (:attr:`header`'s)."""
        header = self.header
        header.send.fill(0)
        fill_slot(header.send, self.step[0], blob, mark, plan, payload)
        return header.start(), (header.send, header.recv)

    def enter(self, what: str) -> None:
        """Before an exchange of ``what``: raises when this communicator can make no
        step (closed, ended, broken) or another node sent a failure notice."""
        if self._comm is None:
            raise SynkError(f"{what} on a closed MPI communicator")
        if self.ended is not None:
            raise SynkError(f"{what}: {self.ended}; call synk.close() (and synk.fork() to go on) here too")
        if self._notices.received() is not None:
            self._peer_failed(what)
        if self.broken is not None:
            raise SynkError(f"the MPI communicator was abandoned after an earlier failure "
                            f"({self.broken}); call synk.close() and synk.fork() again")

    def enter_exchange(self, what: str) -> None:
        """:meth:`enter`; PeerFailed when this step failed on every node at an earlier exchange (none
        makes another: every node makes the same number of exchanges in it, whatever each had left)."""
        self.enter(what)
        if self._failed is not None:
            raise PeerFailed(f"{what}: {self._failed}")

    def wait(self, reqs, what: str, keep=None, notices: bool = True, header: bool = False) -> None:
        """Until every request in ``reqs`` completes; ``check()`` between slices,
        and a peer's failure notice ends the wait at once. Never a blocking wait.

        ``keep`` holds the buffers the requests use: MPI may still read or
        write them after a wait is abandoned, so they are then kept for the
        communicator's lifetime instead of returned to the allocator.
        """
        Testall = self._MPI.Request.Testall

        def ready() -> bool:
            if notices and self._notices.received() is not None:
                self._peer_failed(what, in_header=header)
            return Testall(reqs)

        try:
            for _ in range(FIRST_TESTS):  # (a small step's answer is usually a few us away)
                if Testall(reqs):
                    return
            self.waiting = what  # a timeout meanwhile names the other nodes (Session.poll)
            wait_until(ready, self.check, spin=SPIN_SECONDS, check_every=WAIT_SLICE,
                       first_sleep=POLL_SLEEP, max_sleep=POLL_SLEEP_MAX)
        except BaseException as exc:
            # a leave's exchange completes later (see _answer_leave): its buffers outlive this object
            (state.mpi_leaving if self.ended is not None and header else self._abandoned).append((reqs, keep))
            if not isinstance(exc, NodeFailedError):
                # (a stop of this node's own, such as close() meanwhile, says what it was in words)
                self.abort(getattr(exc, "notice", None) or f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.waiting = None

    def abort(self, reason: str) -> None:
        """Abandon the communicator and tell every other node why.

        Called when this node cannot finish a collective it has entered (or
        may have entered elsewhere): the others raise :class:`NodeFailedError`
        within one poll instead of waiting for it.
        """
        if self.broken is not None:
            return
        self.broken = reason
        if self._notices is not None:
            self._notices.send((self.rank, reason), lambda v: (v[0], v[1][:NOTICE_BYTES // 2] + " ..."))

    def plan_step(self, mark: int, words, what: str = "all_reduce") -> int:
        """A kept plan's step (see :mod:`.mpi_plans`): numbered first (:meth:`begin_marked`),
        then entered (:meth:`enter`, which raises when no step can be made); its number."""
        self.begin_marked(mark, words)
        self.enter(what)
        return self.step[0]

    def plan_exchanged(self, equal: bool) -> None:
        """A kept plan's step made its exchange of header slots; ``equal``: every node's
        head and blob was this node's (none has joined)."""
        self._exchanges += 1
        self.plan_steps += 1
        if equal and self.joined:
            self.joined = []

    def settle_slots(self, what: str, values, slots, blob: bytes, op: str | None, root=None):
        """A kept plan's exchange found slots that differ from the plan's (see
        :mod:`.mpi_plans`): read them as the full path does (a node that joined, left,
        failed, is in another step or holds another layout), then do what the full path
        would, or raise as it would: reduce into ``values`` in place (``op``), or, for a
        broadcast from node ``root`` (``op`` None), return node ``root``'s values (new
        arrays; its own ``values`` on that node)."""
        heads, metas = self._read_headers_long(what, slots, blob)
        try:
            self._same_step(what, heads)
            no_failure(what, metas)
        except (StepMismatchError, PeerFailed, TypeError) as err:  # (as _agree: in a numbered step only)
            self._failed = f"this step failed on every node at an earlier exchange ({type(err).__name__})" \
                if self.begun else None
            raise
        pairs = [(m[0], m[1]) for m in metas]
        if op is None:  # (_broadcast_rest copies a payload out of the slots)
            return self._broadcast_rest(values if self.rank == root else None, pairs, root, payload=metas[root][3])
        # the payload views are of the plan's kept slots: copied before the slots are used again
        payloads = [None if m[3] is None else [np.array(p) for p in m[3]] for m in metas]
        self._reduce_rest(what, list(values), pairs, payloads, op, None, in_place=True)
        return None

    def started(self, what: str, start):
        """``start()`` (buffers and MPI calls); a local error there abandons the
        communicator and tells the others, who would otherwise wait for this node."""
        try:
            return start()
        except BaseException as exc:
            self.abort(f"{type(exc).__name__}: {exc}")
            raise

    # -- agreement ---------------------------------------------------------

    def begin(self, key: tuple | None, words) -> None:
        """This node starts its next step. Its number and ``key`` (what must be the
        same on every node: the kind of step, the function or variables, the op, as
        a checksum) travel in every exchange of the step, so nodes in different steps
        raise :class:`StepMismatchError`, every one of them, at their first exchange,
        never combine what they should not. ``words`` (a string, or a function and
        its arguments that make it, as a tuple) name the step in that error: they
        travel only then. ``key`` None: a step that failed before it knew its key,
        its checksum FAILED (which matches any step of its number)."""
        self.begin_marked(FAILED if key is None else self.mark_of(key), words)

    def mark_of(self, key: tuple) -> int:
        """The checksum of step key ``key`` that travels in its steps' exchanges (see :meth:`begin`)."""
        crc = self._crcs.get(key)
        if crc is None:
            if len(self._crcs) >= 4096:
                self._crcs.clear()
            crc = self._crcs[key] = zlib.crc32(repr(key).encode())
        return crc

    def begin_marked(self, mark: int, words) -> None:
        """:meth:`begin` of a step whose key's checksum is ``mark`` (:meth:`mark_of`)."""
        self.step = (self.step[0] + 1, mark)
        self._words = words
        self.begun += 1
        self._exchanges = 0
        self._failed = None

    def fail_step(self, what: str, reason: str | list, begun: bool) -> None:
        """This node's step failed here before its first exchange (a bad argument, a
        failed check, an error of its own before the others heard of it): make that
        exchange all the same, flagging the failure, so that every node raises
        :class:`PeerFailed` (or :class:`StepMismatchError`) in this very step and the
        next step agrees. ``begun``: whether the step was numbered already (else it is
        numbered now, its checksum FAILED, which matches any step of its number).
        Nothing travels once the step made an exchange (the others heard of it there)
        or when no step can be made any more; errors here are dropped (the caller
        raises its own)."""
        if not begun:
            self.begin(None, f"{what} (failed here: {reason})"[:STEP_TEXT])  # (checksum FAILED)
        if self._exchanges or self._failed is not None or self._comm is None or self.broken is not None \
                or self.ended is not None:
            return
        try:
            self._agree(what, None, failed=f"{what} failed there: {reason}")
        except (PeerFailed, StepMismatchError, NodeFailedError, TypeError, SynkError):
            pass

    def _mismatch(self, what: str, heads) -> StepMismatchError:
        """Every node found that the steps differ: one more exchange, of each node's
        words for its step (every node makes it, then raises the same error). Every
        node then takes the largest step number of the nodes taking part, so the next
        step agrees again (a node that made one step more, or fewer, is caught up)."""
        words = self._words if isinstance(self._words, str) else self._words[0](*self._words[1:])
        mine, every = step_text(f"{words} (step {self.step[0]})"), np.zeros((self.size, STEP_TEXT), dtype=np.uint8)
        self.wait([self._comm.Iallgather([mine, self._MPI.BYTE], [every, self._MPI.BYTE])], what,
                  (mine, every))
        texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
        numbers = [h.number for h in heads if h.mark != JOINED]
        if numbers:
            self.step = (max(numbers), self.step[1])
        return StepMismatchError(what, texts)

    def _agree(self, what: str, arrays, weight=1.0, failed=False, inline=False, op=None, root=None):
        """Every node's ``(layout or None, weight)``; PeerFailed everywhere if one failed.

        With ``inline``, arrays of at most ``INLINE_BYTES`` in all travel in the
        header too, and ``(metas, payloads)`` is returned: each node's arrays
        (views of the received slots), or None where they did not travel. ``what``,
        ``op`` and ``root`` tell a node that has joined (see :meth:`join`) which
        exchange follows. A node that has joined gives ``(None, 0.0)``: nothing to add.
        """
        self.enter_exchange(what)
        layout = None if arrays is None else [(a.dtype, tuple(int(d) for d in a.shape)) for a in arrays]
        # a failure may come with its reason (a string: what failed where), cut to fit
        flag = failed[:HEADER_SLOT // 2] if isinstance(failed, str) and failed else bool(failed)
        payload, meta = None, (layout, float(weight), flag, bool(inline and arrays is not None and not failed))
        blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        if meta[3]:  # (True pickles as long as False: the fit is known before the values are left out)
            if payload_fits(arrays, len(blob)):
                payload = arrays
            else:
                meta = (layout, float(weight), flag, False)
                blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        plan = (WHAT_CODES.get(what, 0), OP_CODES[op], -1 if root is None else root)
        heads, metas = self._headers(what, meta, blob, self.step[1], plan, payload)
        try:
            self._same_step(what, heads)
            no_failure(what, metas)
        except (StepMismatchError, PeerFailed, TypeError) as err:
            if self.begun:  # (a communicator whose user numbers no steps makes each exchange a step)
                self._failed = f"this step failed on every node at an earlier exchange ({type(err).__name__})"
            raise
        pairs = [(m[0], m[1]) for m in metas]
        return (pairs, [m[3] for m in metas]) if inline else pairs

    def _headers(self, what: str, meta, blob: bytes, mark: int, plan, payload=None):
        """One exchange of every node's header: ``(heads, metas)``, each node's
        :class:`Head` and its ``meta`` (``(layout, weight, flag, payload views or
        None)``; pickled into its slot as ``blob``, or in a second, sized round when
        too long)."""
        req, keep = self._post_header(blob, mark, plan, payload)
        self.wait([req], what, keep, header=True)
        self._exchanges += 1
        return self._read_headers(what, keep[1], blob, meta)

    def _read_headers(self, what: str, slots, blob: bytes, meta):
        """Every node's :class:`Head` and meta from the received ``slots`` (see
        :meth:`_headers`). When every node's head and blob are byte for byte this
        node's (the same step number and key, layouts, weight, flag, what, op and
        root), every meta is ``meta``: nothing is unpickled, and the payloads are
        views of the slots. Otherwise each is read: a node that left, that joined,
        or whose blob did not fit, as before."""
        equal = read_equal(slots, self.rank, blob, meta)
        if equal is None:
            return self._read_headers_long(what, slots, blob)
        self.joined = list(range(self.size)) if equal[0][0].mark == JOINED else []
        return equal

    def _read_headers_long(self, what: str, slots, blob: bytes):
        """:meth:`_read_headers` when the slots differ: each node's head and blob read on its own."""
        MPI, size = self._MPI, self.size
        room = HEADER_SLOT - HEAD.size
        heads = [Head._make(HEAD.unpack_from(slots[r])) for r in range(size)]
        lens = [h.length for h in heads]
        marks = {h.mark for h in heads}
        if LEFT in marks:  # its last header: it takes no step any more (no second round either)
            node = next(r for r, h in enumerate(heads) if h.mark == LEFT)
            reason = left_reason(slots[node], lens[node])
            self.ended = f"node {node} left after a failure ({reason})"
            raise NodeFailedError(node, f"it left after a failure: {reason}", what)
        if max(lens) <= room:
            blobs = [slots[r, HEAD.size:HEAD.size + n].tobytes() for r, n in enumerate(lens)]
        else:  # somebody's header did not fit: everybody sends it again, sized
            displs = [sum(lens[:r]) for r in range(size)]
            recv = np.empty(sum(lens), dtype=np.uint8)
            send = np.frombuffer(blob, dtype=np.uint8)
            self.wait([self._comm.Iallgatherv([send, MPI.BYTE], [recv, (lens, displs), MPI.BYTE])],
                      what, (send, recv))
            blobs = [recv[d:d + n].tobytes() for d, n in zip(displs, lens)]
        self.joined = [r for r, h in enumerate(heads) if h.mark == JOINED] if JOINED in marks else []
        return heads, [read_meta(slots[r], b, lens[r]) for r, b in enumerate(blobs)]

    def _same_step(self, what: str, heads) -> None:
        """StepMismatchError (on every node, after one more exchange) when the nodes that
        have not joined are in different steps (:func:`.mpi_wire.steps_differ`)."""
        if steps_differ(heads):
            raise self._mismatch(what, heads)

    def leave(self, reason: str) -> None:
        """This node can make no more steps (its fork broke between two of its
        exchanges, e.g. a worker died in the last local step of a collective):
        post its last header, which says so, without waiting. The others' next
        exchange (the one they wait in, if they do) ends with it:
        :class:`NodeFailedError` naming this node and ``reason`` on each, at once
        rather than when this node acts again; nothing is left outstanding there,
        so every node can close and fork again, and MPI finalises cleanly.
        Only at a step's end: never between the exchanges of one step."""
        if self._comm is None or self.broken is not None or self.ended is not None:
            return
        blob = pickle.dumps((None, 0.0, str(reason)[:HEADER_SLOT // 2], False), protocol=pickle.HIGHEST_PROTOCOL)
        self._leaving = self._post_header(blob, LEFT)
        # MPI moves the header only when this node next calls it (maybe not for a long
        # while: its script is busy): a notice, sent at once, tells the others now
        self._notices.send((self.rank, str(reason)[:NOTICE_BYTES // 2], "left"), lambda v: v)
        self.ended = f"this node left the other nodes after its failure ({reason})"

    def join(self) -> int:
        """This node has no more steps of its own (its data ran out): until every node
        has joined, take part in the other nodes' exchanges with nothing to add, so
        that their reductions go on over their own parts (``avg`` over their weights),
        their gathers without this node's, and a broadcast from this node raises
        there. Returns the index of the node that joined last (the smallest, if
        several joined at the same exchange), the same on every node.

        Raises:
            NodeFailedError: another node failed or left meanwhile.
            SynkError: the other nodes closed (``synk.close()``) without joining;
                this communicator then only closes.
        """
        self.enter("join")
        self._words = "join()"
        served = 0
        meta = (None, 0.0, False, False)
        blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        while True:
            heads, metas = self._headers("join", meta, blob, JOINED, (0, 0, served))
            active = [r for r, h in enumerate(heads) if h.mark != JOINED]
            if not active:  # every node has joined: the same step number everywhere from here on
                self.step = (max(h.number for h in heads), 0)
                return min(r for r, h in enumerate(heads) if h.root == 0)  # served nothing: joined last
            served += 1
            try:
                self._same_step("join", heads)
                no_failure("join", metas)
            except (StepMismatchError, PeerFailed, TypeError):
                continue  # the others raise; nothing moves
            head = heads[active[0]]
            what, op, root = WHATS[head.what], OPS[head.op], None if head.root < 0 else head.root
            pairs = [(m[0], m[1]) for m in metas]
            try:
                if what in ("all_reduce", "reduce"):
                    self._reduce_rest(what, None, pairs, [m[3] for m in metas], op, root)
                elif what in ("all_gather", "gather"):
                    self._gather_rest(what, None, pairs, root, None, [m[3] for m in metas])
                elif what == "broadcast":
                    self._broadcast_rest(None, pairs, root, payload=metas[root][3])
                elif what == "close":
                    self.ended = f"nodes {active} closed (synk.close()) while node {self.rank} waited in join()"
                    raise SynkError(f"join(): {self.ended}, without joining; every node calls "
                                    "synk.join() before it closes")
            except ValueError:  # the others raise it too (a broadcast from a node that joined)
                continue

    # -- collectives -------------------------------------------------------

    def barrier(self, failed=False) -> None:
        """An exchange of headers (not MPI's barrier): nodes in different steps find out;
        ``failed`` (a reason, or True) makes every node raise :class:`PeerFailed`."""
        self._agree("barrier", None, failed=failed)

    def _reduce(self, arrays, op, weight, failed, root, in_place=False, into=None):
        what = "all_reduce" if root is None else "reduce"
        if op not in MPI_OPS:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(MPI_OPS)}")
        if root is not None and not 0 <= root < self.size:
            raise ValueError(f"reduce: root must be a node rank (0 to {self.size - 1}), got {root!r}")
        arrays = None if arrays is None else [np.asarray(a) for a in arrays]
        metas, payloads = self._agree(what, arrays, weight, failed, inline=True, op=op, root=root)
        return self._reduce_rest(what, arrays, metas, payloads, op, root, in_place, into)

    def _reduce_rest(self, what, arrays, metas, payloads, op, root, in_place=False, into=None):
        """A reduction once every node's header is known (see :meth:`_agree`)."""
        present, layout = agreed_layout(metas, op, who="node")
        if not present:
            return None
        contrib = arrays
        if op == "avg" and 0 < sum(1 for r in present if metas[r][1] > 0) < len(present):
            # a node with no rows (weight 0: its master computed an empty batch) adds nothing
            present = [r for r in present if metas[r][1] > 0]
            contrib = arrays if self.rank in present else None
        weights = [metas[r][1] for r in present]
        pre = post = None
        if op == "avg":
            pre, post = avg_scales(weights, metas[self.rank][1] if contrib is not None else 0.0)
        gets = root is None or self.rank == root
        if all(payloads[r] is not None for r in present):  # small: it all came with the agreement
            return inline_reduce(arrays, layout, payloads, op, present, weights, in_place) if gets else None
        into = into if root is None else None
        fit = fit_into(into, layout, op)
        start = functools.partial(self._start_reduce, contrib, layout, op, pre, root,
                                  in_place if fit is None else fit, gets, metas)
        reqs, jobs, keep, folded = self.started(what, start)
        self.wait(reqs, what, keep)
        if folded[0]:  # (the arrays MPI's bytes carry, folded in node order: see mpi_wire.fold_reduce)
            fold_reduce(self, (self._MPI, self._comm), folded[0], folded[1], folded[2], keep, what, root)
        if not gets:
            return None  # (below: with ``into``, the results are in it already, or copied there)
        return finish_reduce(into, layout, jobs, op, present, weights, post, True) if into is not None \
            else finish_reduce(arrays, layout, jobs, op, present, weights, post, in_place)

    def _scratch(self, dtype, shape, i: int = 0) -> np.ndarray:
        """The receive buffer of array ``i`` of an in-place all-reduce of this dtype
        and shape, kept from one call to the next: its pages are faulted in once (a
        fresh 64 MiB buffer costs thousands of page faults per call). One per layout
        and index (two arrays of one call never share one), the last one used."""
        key = (np.dtype(dtype).str, tuple(shape), i)
        buf = self._recv.get(key)
        if buf is None:
            if len(self._recv) >= 8:
                self._recv.clear()
            buf = self._recv[key] = np.empty(shape, dtype=dtype)
        return buf

    def _start_reduce(self, arrays, layout, op, pre, root, in_place, gets, metas):
        """Post the reduction of every array of ``layout``: ``(requests, jobs, buffers to keep, folded)``;
        the arrays MPI's bytes carry go in ``folded`` (sends, receives, folds) for mpi_wire.fold_reduce."""
        folded: tuple = ([], [], [])
        reqs: list = []
        keep: list = [folded]
        jobs = []
        for i, (dtype, shape) in enumerate(layout):
            plan = reduce_plan(dtype, op)
            count = math.prod(shape)
            mine = None if arrays is None else arrays[i]
            if plan is None:  # gathered as bytes, combined here as ops.combine does
                jobs.append(("local", self._start_gather(mine, metas, i, root, reqs, keep)))
                continue
            work, name = plan
            if count == 0:
                jobs.append(("empty", None))
                continue
            if mine is None:  # (never MPI.IN_PLACE: Open MPI's Iallreduce of 64 MiB took 87 ms so, 34 ms out of place)
                send = np.full(shape, identity(op, work), dtype=work)
            elif pre is not None:
                send = np.asarray(mine.astype(work) * work.type(pre))  # (0-d: a scalar otherwise, whose reshape is a copy)
            elif mine.dtype.kind == "b" and work.kind == "u":
                send = np.ascontiguousarray(mine).view(work)
            else:
                send = np.ascontiguousarray(mine, dtype=work)
            if isinstance(in_place, list) and in_place[i] is not None:  # straight into the caller's
                recv = in_place[i]
            elif in_place and root is None and mine is not None:  # copied out before anyone sees it
                recv = self._scratch(work, shape, i)
            else:
                recv = np.empty(shape, dtype=work) if gets else None
            flat_send = send.reshape(-1)  # views: both are contiguous
            flat_recv = None if recv is None else recv.reshape(-1)
            # (the ring must not read what it writes)
            folded[0].append(flat_send.copy() if np.may_share_memory(flat_send, flat_recv) else flat_send)
            folded[1].append(flat_recv)
            folded[2].append(ring_fold(work, name))
            jobs.append(("mpi", recv))
            keep += [send, recv, flat_send, flat_recv]  # (what MPI reads and writes: the flat views too)
        return reqs, jobs, keep, folded

    def _start_gather(self, mine, metas, i, root, reqs, keep):
        """Post the gather of every node's array ``i`` as bytes; the result is a
        function returning the list of parts over nodes (None where absent)."""
        MPI = self._MPI
        gets = root is None or self.rank == root
        lays = [lay[i] if lay is not None else None for lay, _ in metas]
        sizes = [0 if lay is None else math.prod(lay[1]) * np.dtype(lay[0]).itemsize for lay in lays]
        displs = [sum(sizes[:r]) for r in range(self.size)]
        send = as_bytes(mine) if mine is not None and mine.nbytes else np.empty(0, dtype=np.uint8)
        recv = np.empty(sum(sizes), dtype=np.uint8) if gets else None
        keep += [send, recv]
        if sum(sizes) > mpi_wire.PIECE_BYTES:  # displacements or counts past a C int: node by node, in pieces
            reqs += gather_in_pieces(self._comm, self._MPI, send, recv, sizes, displs, root)
        else:
            spec = [recv, (sizes, displs), MPI.BYTE] if gets else None
            if root is None:
                reqs.append(self._comm.Iallgatherv([send, MPI.BYTE], spec))
            else:
                reqs.append(self._comm.Igatherv([send, MPI.BYTE], spec, root))
        return GatherParts(lays, sizes, displs, recv)

    def reduce(self, arrays, op, root, weight=1.0, failed=False):
        """``op`` over every node's arrays (None: nothing to add); the result on
        node ``root``, None elsewhere and when no node contributed.

        Raises:
            PeerFailed: some node flagged ``failed``; nothing was combined.
            ValueError: the nodes' arrays differ in dtype or shape.
            NodeFailedError: another node failed while this one waited.
        """
        return self._reduce(arrays, op, weight, failed, root)

    def all_reduce(self, arrays, op, weight=1.0, failed=False, in_place=False, into=None):
        """``op`` over every node's arrays; the result on every node.

        With ``in_place`` the result is written into this node's ``arrays``
        (through :func:`.ops.cast_to`: the ``avg`` of integers is rounded) and
        they are returned (MPI receives into a buffer kept for the next call,
        then it is copied: Open MPI's ``Iallreduce`` is much slower in place).
        ``into`` (arrays not overlapping ``arrays``) receives the result
        instead, and is returned: MPI writes there directly where the dtype is
        the one reduced in. A node that gave None gets new arrays.
        """
        return self._reduce(arrays, op, weight, failed, None, in_place, into)

    def _gather(self, arrays, root, failed, join, what):
        if root is not None and not 0 <= root < self.size:
            raise ValueError(f"gather: root must be a node rank (0 to {self.size - 1}), got {root!r}")
        arrays = None if arrays is None else [np.asarray(a) for a in arrays]
        # (each node's values travel in its header where they fit: where every node's did,
        # that one exchange is the gather)
        metas, payloads = self._agree(what, arrays, 1.0, failed, inline=True, root=root)
        return self._gather_rest(what, arrays, metas, root, join, payloads)

    def _gather_rest(self, what, arrays, metas, root, join, payloads):
        """A gather once every node's header is known; ``payloads``: per node, its values
        (views of its received header slot) where they travelled there, else None."""
        counts = {len(lay) for lay, _ in metas if lay is not None}
        if len(counts) > 1:
            raise ValueError(f"cannot gather: the nodes hold different numbers of arrays "
                             f"{[None if lay is None else len(lay) for lay, _ in metas]}")
        n = counts.pop() if counts else 0
        if all(payloads[r] is not None for r, (lay, _) in enumerate(metas) if lay is not None):
            return None if root is not None and self.rank != root else gathered_inline(payloads, n, join)

        def start():
            reqs: list = []
            keep: list = []
            views = [self._start_gather(None if arrays is None else arrays[i], metas, i, root, reqs, keep)
                     for i in range(n)]
            return reqs, views, keep

        reqs, views, keep = self.started(what, start)
        self.wait(reqs, what, keep)
        if root is not None and self.rank != root:
            return None
        out = []
        for i, parts in enumerate(views):
            parts = [parts[r] for r in range(self.size)]
            out.append(parts if join is None else join(i, parts))
        return out

    def gather(self, arrays, root, failed=False, join=None):
        """On node ``root``, for each array, the list over nodes of its copies
        (None where a node gave none), or ``join(i, parts)`` of that list; None
        elsewhere."""
        return self._gather(arrays, root, failed, join, "gather")

    def all_gather(self, arrays, failed=False, join=None):
        """As :meth:`gather`, on every node."""
        return self._gather(arrays, None, failed, join, "all_gather")

    def broadcast(self, arrays, root, failed=False, receive=None, what="broadcast"):
        """Node ``root``'s arrays on every node (root gets its own back);
        ``receive(i, array)``, if given, places array ``i`` on the other nodes
        and returns what to give back for it.

        Raises:
            ValueError: root gave no arrays (on every node).
        """
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root must be a node rank (0 to {self.size - 1}), got {root!r}")
        is_root = self.rank == root
        arrays_ = [np.asarray(a) for a in arrays] if is_root and arrays is not None else None
        # (root's values travel in its header where they fit: one exchange, as a kept plan's)
        metas, payloads = self._agree("broadcast", arrays_, 1.0, failed, inline=True, root=root)
        return self._broadcast_rest(arrays_, metas, root, receive, what, payloads[root])

    def _broadcast_rest(self, arrays_, metas, root, receive=None, what="broadcast", payload=None):
        """A broadcast once every node's header is known; ``payload``: root's values, views of
        its received header slot, where they travelled there."""
        is_root = self.rank == root
        layout = metas[root][0]
        if layout is None:
            if root in self.joined:
                raise ValueError(f"{what}: root node {root} has joined (synk.join()): it has no "
                                 "values to send")
            raise ValueError(f"{what}: root node {root} gave no arrays")
        if payload is not None:  # (copied: the slots serve the next exchange)
            out = arrays_ if is_root else [np.array(p, copy=True) for p in payload]
            return out if is_root or receive is None else [receive(i, a) for i, a in enumerate(out)]
        MPI = self._MPI
        sizes = [math.prod(s) * np.dtype(d).itemsize for d, s in layout]

        def start():
            if is_root:
                bufs = [as_bytes(a) if n else None for a, n in zip(arrays_, sizes)]
                # MPI reads root's buffer; a read-only array needs a writable alias
                bufs = [b if b is None or b.flags.writeable else b.copy() for b in bufs]
            else:
                bufs = [np.empty(n, dtype=np.uint8) if n else None for n in sizes]
            reqs = [self._comm.Ibcast([p, MPI.BYTE], root) for b in bufs if b is not None for p in pieces(b)]
            return reqs, bufs

        reqs, bufs = self.started("broadcast", start)
        self.wait(reqs, "broadcast", bufs)
        if is_root:
            return arrays_
        out = [np.empty(s, dtype=d) if b is None else b.view(d).reshape(s)
               for b, (d, s) in zip(bufs, layout)]
        if receive is not None:
            out = [receive(i, a) for i, a in enumerate(out)]
        return out

    def plan(self, kind, layout, op, step=None, reducers=None, weight=1.0):
        """A kept plan of later all-reduces of ``layout`` with ``op`` (see :meth:`.base.Communicator.plan`)
        when every array is of numbers or booleans whose ``op`` result keeps its dtype (no ``avg`` of
        integers): a :class:`.mpi_plans.StepPlan` when all of them travel in the header slot (``weight``:
        the node's), else a :class:`.mpi_plans.LargePlan` where MPI reduces them in their own bytes; a
        call's ``"reduce"``: :class:`.mpi_plans.CallPlan`. None otherwise, or once no step can be made."""
        if self._comm is None or self.broken is not None or self.ended is not None:
            return None
        lines = (self._MPI, self._comm)
        if kind == "reduce":
            return CallPlan.make(self, lines, layout, op, weight)
        if kind == "broadcast":  # (from the master node, as every synk.broadcast across nodes)
            return None if step is None else BroadcastPlan.make(self, lines, layout, step, self.master_rank)
        lay = None if kind != "all_reduce" or op not in MPI_OPS or step is None else plannable_layout(layout, op)
        return None if lay is None else StepPlan.make(self, lines, lay, op, step, weight) or LargePlan.make(
            self, lines, lay, op, step, weight)

    def reset(self) -> None:
        """Nothing to reset: an abandoned MPI collective leaves the communicator broken."""

    def local_reset(self) -> None:
        """Nothing to reset (see :meth:`reset`)."""

    def close(self) -> None:
        """Collective: every node waits for the others, then the duplicated
        communicators are freed with nothing outstanding. A broken communicator
        (an abandoned collective) only releases what is local."""
        if self._comm is None:
            return
        error = None
        if self.broken is None and self.ended is None:
            self.begin(("close",), "close()")
            try:
                self._agree("close", None)
            except BaseException as exc:  # noqa: BLE001 - released below, then raised
                # (a node that left is gone: nothing outstanding, nobody to tell)
                if not (isinstance(exc, NodeFailedError) and self.ended is not None):
                    error = exc
                    # the others may be in another step: they must learn that this node left
                    self.abort(f"node {self.rank} closed (synk.close()): {type(exc).__name__}: {exc}"[:500])
        if self._leaving is not None and not self._leaving[0].Test():
            state.mpi_leaving.append(self._leaving)  # the others complete it at their next exchange
        self._notices.close()  # its receive cancelled, its sends given a moment, freed
        self.header.release(state.mpi_leaving)
        try:
            self._comm.Free()
        except Exception:  # noqa: BLE001 - freed or unusable after a failure
            pass
        self._comm = self._notices = None
        if error is not None:
            raise error
