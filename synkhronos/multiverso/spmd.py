"""One machine without a launcher: fork the workers, watch them, wait with them.

:func:`ForkedWorld.start` forks ``n - 1`` children of the calling process;
every child returns from it and runs the rest of the script (SPMD), as if a
launcher had started ``n`` copies. Rank 0 is the original process.

What the processes share lives in POSIX shared memory under one prefix made
with :func:`synkhronos._procs.shmem.new_prefix` (so ``synk.<pid of rank 0>.``):

- a control segment: per-rank state and exit status, the first failure, the
  barrier's counter and generation, per-rank table descriptors and a slot per
  rank for the traceback of an exception it raised;
- a semaphore used as the control lock, and a pool of semaphores used as the
  tables' stripe locks (see :mod:`.shm_tables`);
- the group's lock file (:class:`synkhronos._procs.lease.Lease`, as for a fork):
  every rank holds a shared lock on it, so whoever leaves last removes the
  names, and a run killed outright has its names reclaimed by the next
  ``init()`` or ``synk.fork()`` on the machine; every rank also holds its own
  byte of it, so a rank whose byte reads free is gone. Its state slot then
  tells a clean end (``shutdown()`` or the end of its script) from a death.

Every wait polls (:func:`synkhronos._procs.waits.wait_until`) and runs :meth:`check`
every :data:`CHECK_EVERY` seconds: the first failure anywhere (an exception
some rank raised, a rank that died) turns into :class:`WorkerFailedError`
naming that rank, with its traceback chained, in every rank's next blocking
call. Rank 0 waits for its children when the script ends, ends them after a
grace period when something failed, removes every name under the prefix, and
makes the exit status non-zero when any rank failed.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from .._procs import children, shmem
from .._arrays import round_up
from ..errors import RemoteTraceback, SynkError, WorkerFailedError, describe_exit
from .._procs.children import Children
from .._procs.lease import Lease
from .._procs.waits import CHECK_EVERY, block_on, take, wait_until

__all__ = ["TableWorld", "ForkedWorld"]

#: Seconds rank 0 waits, once something failed, for the other ranks to end on
#: their own (they raise in their next blocking call) before it kills them.
GRACE = 5.0
#: Bytes of each rank's slot for the traceback of its failure.
ERROR_SLOT = 16384
#: Number of semaphores in the stripe-lock pool.
NUM_STRIPE_LOCKS = 128

# rank states
RUNNING, SHUTDOWN, EXITED, FAILED, DIED = 0, 1, 2, 3, 4
_STATE_TEXT = {RUNNING: "running", SHUTDOWN: "called shutdown()", EXITED: "ended its script",
               FAILED: "raised an exception", DIED: "died"}

# control block (int64 words)
_FIRST_FAILED, _BAR_COUNT, _BAR_GEN, _STARTED = 0, 1, 2, 3
_HEADER = 8
_PER_RANK = 12  # state, exitcode, meta[4] for even barriers, meta[4] for odd ones, wait[2]
_STATE, _EXIT, _META, _WAIT = 0, 1, 2, 10
# what a rank waits in (its _WAIT word; the next word says for what)
NOT_WAITING, IN_BARRIER, IN_SYNC_GET, IN_SYNC_ADD = 0, 1, 2, 3
#: Seconds every working rank must have waited, with nothing changing, before
#: the ranks are declared deadlocked (they called different things).
DEADLOCK_AFTER = 0.5

def _new_lock(name: str) -> posix_ipc.Semaphore:
    """A new semaphore at 1, used as a lock (unlinked with the prefix by unlink_prefix)."""
    return posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=0o600, initial_value=1)


def raised_error(rank: int, size: int, message: str, tb: str, seen_by: int, what: str):
    """The error for a worker that raised ``message`` (its traceback ``tb`` chained)."""
    err = WorkerFailedError(rank, f"worker {rank} of {size} raised {message} "
                                  f"(seen by worker {seen_by} in {what})", tb)
    err.__cause__ = RemoteTraceback(f'\n"""\nTraceback from worker {rank}:\n{tb}"""')
    return err


def stuck_too_long(stuck: dict, waits: list) -> bool:
    """Whether the same ``waits`` were seen for DEADLOCK_AFTER seconds (``stuck`` keeps
    what was seen, and since when)."""
    now = time.monotonic()
    if stuck["seen"] != waits or stuck["since"] is None:
        stuck["seen"], stuck["since"] = waits, now
        return False
    return now - stuck["since"] >= DEADLOCK_AFTER


def deadlock_error(what: str, waits) -> SynkError:
    """The error for workers that all wait in calls none of which can end.

    ``waits``: ``(rank, kind, arg)``; for a barrier ``arg`` is its text, for a
    sync-server wait ``(table index << 32) | count``.
    """
    def text(kind, arg):
        if kind == IN_BARRIER:
            return arg
        count, table = arg & 0xFFFFFFFF, arg >> 32
        if kind == IN_SYNC_GET:
            return f"get() number {count} of table {table}"
        return f"an add() after get() number {count} of table {table}"

    where = ", ".join(f"worker {r} in {text(k, a)}" for r, k, a in waits)
    return SynkError(f"deadlock in {what}: every worker waits for the others ({where}); with a "
                     "sync server every worker must call add() and get() on each table, and "
                     "barrier(), in the same order and the same number of times")


class TableWorld:
    """The world of the parameter-server tables: what :class:`ForkedWorld` and
    ``mpi_world.MpiWorld`` share (not :class:`synkhronos.World`, a node's place)."""

    closed = False

    if TYPE_CHECKING:  # what each world defines
        def check(self, what: str = "this call") -> None: ...
        def _publish(self, kind: int, arg: int) -> None: ...
        def _deadlock(self, what: str, stuck: dict) -> None: ...

    def wait_until(self, pred, what: str, waiting=None, also=None) -> None:
        """Poll ``pred`` until it holds, raising when a peer fails meanwhile.

        ``waiting`` (kind, argument) is published for the deadlock check: when
        every working rank waits and none of their waits can ever end (they
        called different things), each raises instead of hanging. ``also(what)``
        runs with each liveness check.
        """
        self.check(what)
        if pred():
            return
        if waiting is not None:
            self._publish(*waiting)
        stuck = {"since": None, "seen": None}

        def check():
            self.check(what)
            if also is not None:
                also(what)
            if waiting is not None:
                self._deadlock(what, stuck)

        try:
            wait_until(pred, check)
        finally:
            if waiting is not None and not self.closed:
                self._publish(NOT_WAITING, 0)


class ForkedWorld(TableWorld):
    """The processes of one ``mv.init()`` on one machine (see the module docstring).

    Attributes:
        rank: this process's rank (0 is the process that called ``init``).
        size: the number of processes.
        prefix: the shared-memory name prefix of everything they share.
    """

    kind = "fork"

    def __init__(self, size: int, store_class):
        self.store_class = store_class
        self.size = size
        self.rank = 0
        self.lease = Lease.new()  # the group's lock file: created first, unlinked last
        self.prefix = self.lease.prefix
        self.children = Children()
        self.stores: dict = {}
        self.closed = False
        self._probing = False
        self._next_probe = 0.0
        ints = _HEADER + _PER_RANK * size
        self._ctl_bytes = round_up(ints * 8)
        try:
            self.lease.hold(0)
            self._seg = shmem.Segment(self.prefix + "ctl", self._ctl_bytes + ERROR_SLOT * size,
                                      create=True, what="the multiverso control block")
            self._ctl = self._seg.array(np.int64, (ints,))
            self._ctl[_FIRST_FAILED] = -1
            self._lock = _new_lock(self.prefix + "lock.ctl")
            self.stripe_locks = [_new_lock(f"{self.prefix}lock.{i}")
                                 for i in range(NUM_STRIPE_LOCKS)]
        except BaseException:
            shmem.unlink_prefix(self.prefix)
            self.lease.close()
            raise

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        """Fork the other ranks; each child returns from here as its rank."""
        parent = os.getpid()
        if self.children.spawn(range(1, self.size), lambda rank: self._become_child(rank, parent)) is not None:
            return
        self._install_hooks()
        self._await_start()

    def _await_start(self) -> None:
        """A child holds its liveness byte only once it runs: until every child
        does, deaths are seen by rank 0's waitpid only, never by probing."""
        wait_until(lambda: int(self._ctl[_STARTED]) >= self.size - 1, lambda: self.check("init()"))
        self._probing = True

    def _become_child(self, rank: int, parent: int) -> None:
        self.rank = rank
        self.children = Children()
        # what the parent made stays out of this child's collections: the final
        # one (at interpreter exit) otherwise walked all of it, for seconds
        gc.freeze()
        children.set_parent_death_signal()  # the same signal as a fork's workers
        signal.signal(children.PARENT_DEATH_SIGNAL, self._terminated)
        signal.signal(signal.SIGTERM, self._terminated)
        if os.getppid() != parent:  # rank 0 ended before the signal was armed
            self._terminated(children.PARENT_DEATH_SIGNAL, None)
        # the parent's descriptor goes first (closing a descriptor of the file
        # drops this process's record locks on it), then this rank takes its own
        self.lease.close()
        self.lease = Lease(self.prefix)
        self.lease.hold(rank)
        self._install_hooks()
        with self.locked():
            self._ctl[_STARTED] += 1
        self._await_start()

    def _install_hooks(self) -> None:
        previous = sys.excepthook

        def excepthook(tp, value, tb, _previous=previous):
            if not isinstance(value, WorkerFailedError) and not self.closed:
                self.record_failure(value)
            _previous(tp, value, tb)

        sys.excepthook = excepthook
        atexit.register(self._at_exit)
        if self.rank == 0 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._master_terminated)

    def _master_terminated(self, signum, frame):  # noqa: ARG002 - signal handler signature
        """Rank 0 told to stop: end the workers, remove every name, then die of the signal
        as before (its exit status still says SIGTERM)."""
        self.closed = True
        self.children.signal(signal.SIGTERM)
        wait_until(lambda: not any(self._alive(r) for r in self.children.pids), timeout=GRACE)
        self.children.kill_now()
        shmem.unlink_prefix(self.prefix)
        self.lease.close()
        children.die_of(signal.SIGTERM)

    # -- shared state --------------------------------------------------------

    def _slot(self, rank: int, field: int) -> int:
        return _HEADER + _PER_RANK * rank + field

    def state(self, rank: int) -> int:
        return int(self._ctl[self._slot(rank, _STATE)])

    def set_state(self, state: int) -> None:
        with self.locked():
            if self.state(self.rank) in (RUNNING, SHUTDOWN):
                self._ctl[self._slot(self.rank, _STATE)] = state

    def locked(self, lock=None):
        return _Held(self._lock if lock is None else lock, self)

    def record_failure(self, exc: BaseException) -> None:
        """Mark this rank failed with ``exc`` (its traceback goes to its slot)."""
        try:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        except Exception:  # noqa: BLE001 - a broken exception still marks the failure
            text = f"{type(exc).__name__}: (traceback unavailable)"
        blob = pickle.dumps((f"{type(exc).__name__}: {exc}", text))
        if len(blob) > ERROR_SLOT - 8:
            text = text[-(ERROR_SLOT // 2):]
            blob = pickle.dumps((f"{type(exc).__name__}", "...\n" + text))
        with self.locked():
            start = self._ctl_bytes + ERROR_SLOT * self.rank
            self._seg.set_int(len(blob), start)
            self._seg.set_bytes(start + 8, blob)
            self._ctl[self._slot(self.rank, _STATE)] = FAILED
            if self._ctl[_FIRST_FAILED] < 0:
                self._ctl[_FIRST_FAILED] = self.rank

    def _mark_dead(self, rank: int, code) -> None:
        with self.locked():
            if self.state(rank) in (RUNNING, SHUTDOWN):
                self._ctl[self._slot(rank, _STATE)] = DIED
            if code is not None:
                self._ctl[self._slot(rank, _EXIT)] = code
            if self.state(rank) in (FAILED, DIED) and self._ctl[_FIRST_FAILED] < 0:
                self._ctl[_FIRST_FAILED] = rank

    def _alive(self, rank: int) -> bool:
        """Whether process ``rank`` still runs (it holds its byte of the lock file)."""
        return self.lease.alive(rank)

    def _reap(self) -> None:
        """Rank 0: collect the exit status of children that ended."""
        for rank, code in self.children.reap().items():
            if code != 0 or self.state(rank) in (RUNNING, SHUTDOWN, FAILED, DIED):
                self._mark_dead(rank, code)
                if code != 0 and self.state(rank) == EXITED:
                    with self.locked():
                        self._ctl[self._slot(rank, _EXIT)] = code
                        if self._ctl[_FIRST_FAILED] < 0:
                            self._ctl[_FIRST_FAILED] = rank

    def check(self, what: str = "this call", record: bool = True) -> None:
        """Raise :class:`WorkerFailedError` when any rank failed or died.

        ``record=False`` only reads and never takes the control lock (for waits
        on that lock itself, whose holder may be the one that died).
        """
        if record and self.rank == 0 and self.children.pids:
            self._reap()
        now = time.monotonic()
        if self._probing and self._ctl[_FIRST_FAILED] < 0 and now >= self._next_probe:
            self._next_probe = now + CHECK_EVERY / 2  # cheap enough for every add and get
            for r in range(self.size):
                if r != self.rank and self.state(r) in (RUNNING, SHUTDOWN) and not self._alive(r):
                    # it may have ended cleanly between the two reads
                    if self.state(r) in (RUNNING, SHUTDOWN):
                        if not record:
                            raise WorkerFailedError(r, f"worker {r} of {self.size} died (seen by "
                                                       f"worker {self.rank} in {what})")
                        self._mark_dead(r, None)
        first = int(self._ctl[_FIRST_FAILED])
        if first >= 0 and first != self.rank:
            raise self.failure(first, what)

    def failure(self, rank: int, what: str) -> WorkerFailedError:
        state = self.state(rank)
        code = int(self._ctl[self._slot(rank, _EXIT)]) if self.state(rank) != FAILED else None
        if state == FAILED:
            start = self._ctl_bytes + ERROR_SLOT * rank
            n = self._seg.get_int(start)
            message, tb = pickle.loads(self._seg.get_bytes(start + 8, start + 8 + n))
            return raised_error(rank, self.size, message, tb, self.rank, what)
        known = code if (state == DIED and code) else None
        if state == EXITED:
            return WorkerFailedError(rank, f"worker {rank} of {self.size} ended with "
                                           f"{describe_exit(code)} (seen by worker {self.rank} in "
                                           f"{what})", exitcode=code)
        return WorkerFailedError(rank, f"worker {rank} of {self.size} died ({describe_exit(known)}) "
                                       f"(seen by worker {self.rank} in {what})", exitcode=known)

    def _publish(self, kind: int, arg: int) -> None:
        base = self._slot(self.rank, _WAIT)
        self._ctl[base + 1] = arg
        self._ctl[base] = kind

    def _can_end(self, kind: int, arg: int):
        """Whether a wait of ``kind`` for ``arg`` can end now (None: cannot tell)."""
        if kind == IN_BARRIER:
            return int(self._ctl[_BAR_GEN]) != arg
        store = self.stores.get(arg >> 32)
        if store is None or store.arrived is None:
            return None
        count = arg & 0xFFFFFFFF
        marks = store.arrived if kind == IN_SYNC_GET else store.copied
        return all(marks[s] >= count or self.finished(s) for s in range(self.size))

    def _deadlock(self, what: str, stuck: dict) -> None:
        waits = []
        for r in range(self.size):
            if self.finished(r):
                continue
            kind = int(self._ctl[self._slot(r, _WAIT)])
            arg = int(self._ctl[self._slot(r, _WAIT) + 1])
            if kind == NOT_WAITING or self._can_end(kind, arg) is not False:
                stuck["since"] = None
                return
            waits.append((r, kind, arg))
        if stuck_too_long(stuck, waits):
            raise deadlock_error(what, [(r, k, "barrier()" if k == IN_BARRIER else a)
                                    for r, k, a in waits])

    # -- collective steps ------------------------------------------------------

    def _gone(self, what: str) -> None:
        for r in range(self.size):
            s = self.state(r)
            if r != self.rank and s in (SHUTDOWN, EXITED):
                raise SynkError(f"{what}: worker {r} of {self.size} {_STATE_TEXT[s]} and will never "
                                f"reach it (every worker must call {what} the same number of times)")

    def barrier(self, what: str = "barrier()", meta=None) -> list | None:
        """Wait until every rank arrives. With ``meta`` (4 ints), return every rank's."""
        self.check(what)
        self._gone(what)
        with self.locked():
            gen = int(self._ctl[_BAR_GEN])
            # a fast rank may write the next barrier's meta while a slow one still
            # reads this one's: alternate between two places
            where = _META + 4 * (gen % 2)
            if meta is not None:
                base = self._slot(self.rank, where)
                self._ctl[base:base + 4] = meta
            self._ctl[_BAR_COUNT] += 1
            if self._ctl[_BAR_COUNT] == self.size:
                self._ctl[_BAR_COUNT] = 0
                self._ctl[_BAR_GEN] = gen + 1

        def passed():
            return int(self._ctl[_BAR_GEN]) != gen

        def gone(w):
            if not passed():
                self._gone(w)

        gone(what)
        self.wait_until(passed, what, (IN_BARRIER, gen), also=gone)
        if meta is None:
            return None
        return [tuple(int(v) for v in self._ctl[self._slot(r, where):self._slot(r, where) + 4])
                for r in range(self.size)]

    def new_store(self, index: int, num_row: int, num_col: int, dtype, init_value):
        """The storage of a new table (collective): one copy in shared memory, made
        by ``store_class`` (``shm_tables.ShmStore``, given by ``api``, which sits above both)."""
        store = self.store_class(self, index, num_row, num_col, dtype, init_value)
        self.stores[index] = store
        return store

    def finished(self, rank: int) -> bool:
        """True when ``rank`` will make no more table calls (shutdown or ended)."""
        return self.state(rank) in (SHUTDOWN, EXITED)

    def shutdown(self) -> None:
        """Leave: wait until every rank has called shutdown() or ended its script."""
        self.check("shutdown()")
        self.set_state(SHUTDOWN)
        self.wait_until(lambda: all(self.finished(r) for r in range(self.size)), "shutdown()")

    # -- the end ---------------------------------------------------------------

    def _terminated(self, signum, frame):  # noqa: ARG002 - signal handler signature
        """A child told to stop (its parent died, or SIGTERM): at once the others see it
        died of ``signum`` (the first failure, if none came before), then it leaves
        and dies of the signal."""
        # no lock here: the handler may have interrupted this process holding one. A
        # lock it held is never released: the others raise, they never wait for it
        slot = self._slot(self.rank, _STATE)
        if self._ctl[slot] in (RUNNING, SHUTDOWN):
            self._ctl[slot] = DIED
            self._ctl[self._slot(self.rank, _EXIT)] = -signum
            if self._ctl[_FIRST_FAILED] < 0:
                self._ctl[_FIRST_FAILED] = self.rank
        self._leave(wait_for_parent=signum == children.PARENT_DEATH_SIGNAL)
        children.die_of(signum)

    def _leave(self, wait_for_parent: bool = False) -> None:
        """Drop this rank's liveness byte; the last process out removes the names.

        ``wait_for_parent`` (a child told to stop): first wait a moment for rank
        0's byte to read free. The parent-death signal comes when the thread
        that forked exits, and rank 0's other threads (BLAS) may still hold
        its files, and so its byte, for a while.
        """
        self.lease.let_go(self.rank)
        if wait_for_parent:
            wait_until(lambda: not self._alive(0), timeout=2.0)
        if not any(self._alive(r) for r in range(self.size) if r != self.rank) and self.lease.last_out():
            shmem.unlink_prefix(self.prefix)
        self.lease.close()

    def _at_exit(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.set_state(EXITED)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        if self.rank != 0:
            self._leave()
            return
        failed = self._wait_children()
        shmem.unlink_prefix(self.prefix)
        self.lease.close()
        if failed is not None:
            sys.stderr.write(f"synkhronos.multiverso: {failed}; exiting with status 1\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _wait_children(self):
        """Rank 0 at exit: wait for every child; end them once something failed.

        Returns the text of the first failure, or None.
        """
        def ended(or_failed: bool) -> bool:
            self._reap()
            return not self.children.alive() or (or_failed and int(self._ctl[_FIRST_FAILED]) >= 0)

        wait_until(lambda: ended(True), spin=0.0, max_sleep=0.005)
        # something failed: the others get GRACE seconds to raise and end, then SIGKILL
        wait_until(lambda: ended(False), timeout=GRACE, spin=0.0, max_sleep=0.005)
        self.children.kill_now()
        first = int(self._ctl[_FIRST_FAILED])
        if first < 0:
            for r, code in self.children.exited.items():
                if code:
                    return f"worker {r} ended with {describe_exit(code)}"
            return None
        return str(self.failure(first, "exit").args[0]).split(" (seen by")[0]


class _Held:
    """``with world.locked():`` a semaphore used as a lock, waited on with liveness checks."""

    __slots__ = ("sem", "world")

    def __init__(self, sem, world):
        self.sem = sem
        self.world = world

    def __enter__(self):
        if not take(self.sem):
            wait_until(lambda: False, lambda: self.world.check("waiting for a lock", record=False),
                       spin=0.0, block=block_on(self.sem, CHECK_EVERY))
        return self

    def __exit__(self, *exc):
        self.sem.release()
        return False


def describe_table(meta) -> str:
    """``(index, rows, cols, dtype num)`` as words, for error messages."""
    _, rows, cols, num = meta
    dtype = next((np.dtype(t) for t in (np.float32, np.float64) if np.dtype(t).num == num), num)
    return f"a {rows}x{cols} table of {dtype}"
