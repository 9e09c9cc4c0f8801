"""Control plane: typed commands from the master to the workers.

A small shared-memory control block carries the command and its pickled
payload (size first, then bytes); POSIX semaphores wake the workers and
collect their completion. Every wait is sliced with a liveness check, so a
dead process is noticed within a fraction of a second and nothing hangs.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import posix_ipc

from .. import _state as state
from ..errors import pack_exception
from .._procs.waits import block_on, take, wait_until
from .replies import ELSEWHERE, ReplyArea
from .._procs.shmem import Segment, close_semaphores, open_semaphore, unlink_segment

__all__ = []

#: How long one slice of a blocking wait lasts before liveness is checked.
WAIT_SLICE = 0.05
#: How long a waiter polls without sleeping before it blocks (seconds).
SPIN_SECONDS = 200e-6
#: How often a polling waiter runs its liveness check.
CHECK_EVERY = 1e-3

_HEADER_WORDS = 16
_W_SEQ, _W_CMD, _W_LEN, _W_GEN, _W_ABORT, _W_EPOCH, _W_BODY, _W_KEEP, _W_PAYGEN = range(9)
#: Kept messages (see ControlBlock.post): the workers hold those of the last
#: this many new bodies unpickled, and the master sends one of them again as
#: its generation alone.
KEEP_WINDOW = 64
#: The payload starts on the first page boundary after the header, which grows with the ranks.
_PAGE = 4096
_PAYLOAD_CAP = 1 << 20
#: Bytes of each worker's reply area, where small function outputs ride back
#: with its answer (see :mod:`synkhronos._protocol.replies`).
REPLY_CAP = 8192
_STATUS_OK, _STATUS_ERROR = 0, 1
#: The error generation of a worker that failed but found no room for its report.
_ERR_NO_ROOM = -1


class Command(enum.IntEnum):
    """What the master asks every worker to do next."""

    DISTRIBUTE = 1
    CALL = 2
    COLLECTIVE = 3
    CLOSE = 5
    INIT_DEVICE = 6


#: value -> Command, a dict lookup instead of the enum's call on every command
_COMMANDS = {int(c): c for c in Command}


def acquire(sem: posix_ipc.Semaphore, check: Callable[[], None], spin: float = SPIN_SECONDS) -> None:
    """Take ``sem``: poll it for ``spin`` seconds, then block in slices
    (:func:`synkhronos._procs.waits.wait_until`); ``check()`` runs every
    ``CHECK_EVERY`` seconds, so a spinning waiter notices a dead peer as
    soon as a blocked one does.

    Polling reads the count (``sem_getvalue``, no system call, no exception)
    and takes a token only when one is there: a loop of calls finds its peers
    awake and never pays a kernel wake-up. Each turn yields the core
    (``sched_yield``): where processes outnumber cores the peer it waits for
    can run, and a poll without it slowed large collectives by 10-40% on a
    2-vCPU machine (the cores' siblings compete).
    """
    if sem.value and take(sem):
        return
    # where processes outnumber cores, read the clock at every turn, not every 32nd
    wait_until(lambda: sem.value and take(sem), check, spin=spin, check_every=CHECK_EVERY,
               block=block_on(sem, WAIT_SLICE), clock_every=1 if state.spin.oversubscribed else 32)


def drain(sem: posix_ipc.Semaphore) -> None:
    """Bring a semaphore back to zero."""
    while True:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return


class ControlBlock:
    """The command mailbox, seen from the master (``create=True``) or a worker."""

    def __init__(self, prefix: str, size: int, master_rank: int, create: bool):
        self.prefix = prefix
        self.size = size
        self.master_rank = master_rank
        self.create = create
        words = _HEADER_WORDS + 3 * size
        offset = -(-words * 8 // _PAGE) * _PAGE
        self._seg = Segment(prefix + "ctl", offset + _PAYLOAD_CAP + REPLY_CAP * size, create=create)
        # the header's words, read and written one at a time (a memoryview: a
        # third of a numpy element access's cost, on every command): per rank
        # its status, its error generation, and the sequence number of the
        # last command it answered (the master's truth for who is done; the
        # done semaphore only wakes it)
        self._words = self._seg.buffer()[:words * 8].cast("q")
        self._status = _HEADER_WORDS
        self._err_gen = _HEADER_WORDS + size
        self._acked = _HEADER_WORDS + 2 * size
        self._taken_seq = 0
        self._payload = self._seg.buffer()[offset:offset + _PAYLOAD_CAP]
        replies = self._seg.array(np.uint8, (size, REPLY_CAP), offset + _PAYLOAD_CAP)
        self._replies = {r: ReplyArea(replies[r]) for r in range(size) if r != master_rank}
        self._out_seq = 0
        self._top = 0               # master: the generation of the newest body written
        self._last_body: bytes | None = None  # master: the kept body of the last command
        self._kept: dict[bytes, int] = {}     # master: kept body -> its generation
        self._message: tuple[int, Any] = (-1, None)  # worker: (body generation, its unpickled message)
        self._kept_messages: dict[int, Any] = {}  # worker: generation -> unpickled message, of kept bodies
        self.message_kept = False   # worker: whether the master may send the last message again
        self._overflow: Segment | None = None
        self._overflow_gen = 0
        self._err_seq = 0
        self.go = {r: open_semaphore(f"{prefix}go{r}", create) for r in range(size) if r != master_rank}
        self.done = open_semaphore(prefix + "done", create)
        self._closed = False

    # -- master side -------------------------------------------------------

    def post(self, cmd: Command, payload: Any, body: bytes | None = None) -> None:
        """Write a command and its payload, then wake every worker.

        ``body``, when given, is ``payload`` pickled already, by a caller that
        sends the same message again and again (a planned call, an inline
        collective). Such a body is *kept*: every worker keeps what it
        unpickled, under the body's generation, and while that generation is
        among the last ``KEEP_WINDOW`` new ones, posting the same bytes again
        sends only the generation: nothing is copied or unpickled, also in a
        loop that alternates between several functions and collectives.
        """
        words = self._words
        fresh: int | None = None  # the generation of a body written now, if one was
        if body is None or body is not self._last_body:  # (the very last message again: all in place)
            keep = body is not None
            if body is None:
                body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(body)
            gen = self._kept.get(body) if keep else None
            if gen is None or gen <= self._top - KEEP_WINDOW:
                gen = fresh = self._write_body(cmd, body, n, keep)
            words[_W_BODY] = gen
            words[_W_LEN] = n
            self._last_body = body if keep else None
        for r in self.go:  # a failure of an earlier command, also one never collected
            if words[self._status + r] != _STATUS_OK:
                words[self._status + r] = _STATUS_OK
        words[_W_CMD] = int(cmd)
        words[_W_SEQ] += 1
        for sem in self.go.values():
            sem.release()
        if fresh is not None and words[_W_KEEP]:  # sent: from now on the workers hold it
            self._kept[body] = fresh
            if len(self._kept) > 2 * KEEP_WINDOW:
                self._kept = {b: g for b, g in self._kept.items() if g > fresh - KEEP_WINDOW}

    def _write_body(self, cmd: Command, body: bytes, n: int, keep: bool) -> int:
        """Put a new body where the workers read it; returns its generation."""
        words = self._words
        if n <= _PAYLOAD_CAP:
            self._payload[:n] = body
            words[_W_GEN] = 0
        else:
            keep = False
            self._overflow_gen += 1
            old, self._overflow = self._overflow, Segment(
                f"{self.prefix}pay{self._overflow_gen}", n, create=True,
                what=f"a {cmd.name} command's payload of {n} bytes")
            self._overflow.buffer()[:n] = body
            if old is not None:
                old.close()
            words[_W_GEN] = self._overflow_gen
        self._top += 1
        words[_W_KEEP] = int(keep)
        words[_W_PAYGEN] = self._top
        return self._top

    def outputs(self, rank: int) -> tuple[tuple[list, float] | None, bool]:
        """Master-side, once worker ``rank`` answered: ``(got, big)``, ``got`` the
        ``(arrays, weight)`` it sent back with :meth:`put_outputs` (views of its
        reply area) or None when it had nothing to add, ``big`` whether they
        came through a segment of their own (too big for the area)."""
        area = self._replies[rank]
        got = area.inline()
        if got is not None:
            return got, False
        if area.state() != ELSEWHERE:
            return None, False
        name = f"{self.prefix}out{rank}.{area.generation()}"
        try:
            seg = Segment(name)
            n = seg.get_int()
            arrays, weight = pickle.loads(seg.buffer()[8:8 + n])
            seg.close()
        finally:
            unlink_segment(name)
        area.put_absent()  # read once: the name is gone
        return (arrays, weight), True

    def reply_area(self, rank: int) -> ReplyArea:
        """Worker ``rank``'s reply area (master-side: read once it answered)."""
        return self._replies[rank]

    def pending(self) -> list[int]:
        """The ranks that have not answered the last command yet."""
        words, seq = self._words, self._words[_W_SEQ]
        return [r for r in self.go if words[self._acked + r] != seq]

    def all_answered(self) -> bool:
        """Whether every worker answered the last command (:meth:`pending` is empty)."""
        words, seq, acked = self._words, self._words[_W_SEQ], self._acked
        for r in self.go:
            if words[acked + r] != seq:
                return False
        return True

    def any_failed(self) -> bool:
        """Whether a worker reported an error for the current command."""
        words = self._words
        return any(words[self._status + r] for r in self.go)

    def collect(self, check: Callable[[], None]) -> dict[int, bytes]:
        """Wait until every worker finished the command; return their errors by rank.

        May be called again after ``check()`` raised (Ctrl-C, a timeout): it
        goes on waiting for the workers that have not answered yet.
        """
        words = self._words
        seq = words[_W_SEQ]
        for rank in self.go:
            at = self._acked + rank
            while words[at] != seq:  # a token may be another rank's: then that one is done too
                acquire(self.done, check)
        if self._overflow is not None:  # every worker has read it: a large payload's memory goes now
            self._overflow.close()
            self._overflow = None
        errors = {}
        for rank in self.go:
            if words[self._status + rank] == _STATUS_ERROR:
                gen = words[self._err_gen + rank]
                if gen == _ERR_NO_ROOM:
                    errors[rank] = pack_exception(MemoryError(
                        f"worker rank {rank} failed, and /dev/shm had no room left for its "
                        "error report; see the memory errors above or free shared memory"), rank)
                    continue
                name = f"{self.prefix}err{rank}.{gen}"
                try:
                    seg = Segment(name)
                    n = int(seg.array(np.int64, (1,))[0])
                    errors[rank] = bytes(seg.buffer()[8:8 + n])
                    seg.close()
                finally:
                    unlink_segment(name)
        return errors

    def set_abort(self, value: bool) -> None:
        self._words[_W_ABORT] = int(value)

    def new_epoch(self) -> None:
        """Tell the workers that the communicator's semaphores were reset."""
        self._words[_W_EPOCH] += 1

    def epoch(self) -> int:
        return self._words[_W_EPOCH]

    def commands(self) -> int:
        """How many commands the master has posted so far."""
        return self._words[_W_SEQ]

    # -- worker side -------------------------------------------------------

    def aborted(self) -> bool:
        return self._words[_W_ABORT] != 0

    def receive(self, rank: int, check: Callable[[], None]) -> tuple[Command, Any]:
        """Block until the next command for this worker; return ``(cmd, payload)``."""
        acquire(self.go[rank], check, spin=state.spin.idle)
        words = self._words
        self._taken_seq = words[_W_SEQ]
        cmd = _COMMANDS[words[_W_CMD]]
        gen = words[_W_BODY]
        if gen == self._message[0]:  # the very message of the last command: unpickled already
            return cmd, self._message[1]
        message = self._kept_messages.get(gen)
        self.message_kept = message is not None
        if message is None:
            message = self._unpickle(gen)
            self.message_kept = words[_W_KEEP] != 0
        self._message = (gen, message)
        return cmd, message

    def _unpickle(self, gen: int) -> Any:
        """The message of a new body (generation ``gen``), kept if the master keeps it."""
        words = self._words
        if words[_W_PAYGEN] != gen:  # never: the master sends a generation alone only while it is kept here
            raise RuntimeError(f"command body {gen} is neither kept by this worker nor the one "
                               f"written ({words[_W_PAYGEN]}): the master and the workers disagree")
        n = words[_W_LEN]
        overflow = words[_W_GEN]
        if overflow == 0:
            body: bytes | memoryview = self._payload[:n]
        else:
            seg = Segment(f"{self.prefix}pay{overflow}")
            body = bytes(seg.buffer()[:n])
            seg.close()
        message = pickle.loads(body)
        if words[_W_KEEP]:
            kept = self._kept_messages
            kept[gen] = message
            if len(kept) > 2 * KEEP_WINDOW:  # the master sends none of those again
                self._kept_messages = {g: m for g, m in kept.items() if g > gen - KEEP_WINDOW}
        return message

    def put_outputs(self, rank: int, arrays: Sequence[np.ndarray] | None, weight: float) -> bool:
        """Worker-side, before :meth:`reply`: send ``arrays`` (a list of numpy
        arrays, or None for nothing to add) back with the answer. Arrays too
        big for the reply area go through a segment of their own, which the
        master reads and unlinks; returns False in that case."""
        area = self._replies[rank]
        if arrays is None:
            area.put_absent()
            return True
        if area.put(arrays, weight):
            return True
        self._out_seq += 1
        body = pickle.dumps((arrays, weight), protocol=pickle.HIGHEST_PROTOCOL)
        seg = Segment(f"{self.prefix}out{rank}.{self._out_seq}", 8 + len(body), create=True,
                      what=f"the outputs of worker rank {rank}")
        seg.set_int(len(body))
        seg.buffer()[8:8 + len(body)] = body
        seg.owner = False  # the master reads and unlinks it
        seg.close()
        area.put_elsewhere(self._out_seq)
        return False

    def reply(self, rank: int, error: bytes | None) -> None:
        """Report this worker's completion, with a packed exception if it failed."""
        if error is not None:
            self._err_seq += 1
            try:
                seg = Segment(f"{self.prefix}err{rank}.{self._err_seq}", 8 + len(error), create=True,
                              what=f"the error report of worker rank {rank}")
            except (MemoryError, OSError):  # a full /dev/shm: the master still learns of a failure
                self._words[self._err_gen + rank] = _ERR_NO_ROOM
            else:
                seg.array(np.int64, (1,))[0] = len(error)
                seg.buffer()[8:8 + len(error)] = error
                seg.owner = False  # the master reads and unlinks it
                seg.close()
                self._words[self._err_gen + rank] = self._err_seq
            self._words[self._status + rank] = _STATUS_ERROR
        self._words[self._acked + rank] = self._taken_seq
        self.done.release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._payload.release()
        self._words.release()
        # views keep the mapping alive: drop every one, so the block is unmapped now
        self._words = self._replies = None  # type: ignore[assignment]  # closed: never used again
        self._kept = {}
        self._last_body = None
        self._message = (-1, None)
        self._kept_messages = {}
        close_semaphores([*self.go.values(), self.done], unlink=self.create)
        if self._overflow is not None:
            self._overflow.close()
        self._seg.close()
