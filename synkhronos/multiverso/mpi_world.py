"""Under an MPI launcher: every rank is a worker and serves a slice of every table.

Imported only when a launcher started the process (see
:func:`.api.under_launcher`). MPI is initialised here, not when mpi4py is
imported (``mpi4py.rc.initialize = False``), and finalised by ``shutdown()``
(or at exit) after every window is freed: a window still locked or allocated
at ``MPI_Finalize`` hangs Open MPI.

- Each table is split across the ranks in contiguous row ranges (an array
  table's values are its rows) and lives in one MPI window per table
  (``Win.Allocate``, displacement unit 1 byte). ``add`` is ``Win.Accumulate``
  with ``SUM`` into each owner's range, under a shared passive-target lock
  (accumulates of one op and one basic type are element-wise atomic, so no
  update is lost); ``get`` is ``Win.Get`` under a shared lock. Both complete
  at ``Unlock``, so an add is applied when it returns.
- Rank 0's window of each table starts with the sync server's counters (the
  number of gets each rank has issued and taken); a state window on rank 0
  holds each rank's state (running, shut down, ended).
- Collective steps (barriers, agreeing on a new table) are non-blocking MPI
  calls polled with ``Test`` between short sleeps, never a blocking wait, so
  a failure notice from another rank ends them at once.
- A rank that raises sends its traceback to every other rank (on a
  communicator of its own); their next blocking call raises
  :class:`~.spmd.WorkerFailedError` naming it. A rank that dies outright is
  mpirun's to report: it stops the job.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback

import numpy as np

from .._procs import launch
from ..errors import SynkError, WorkerFailedError
from .._procs.waits import wait_until
from .spmd import (describe_table, EXITED, IN_BARRIER, IN_SYNC_ADD, IN_SYNC_GET, NOT_WAITING,
                   RUNNING, SHUTDOWN, TableWorld, deadlock_error, raised_error, stuck_too_long)

__all__ = ["MpiWorld", "MpiStore"]

#: Largest failure notice (bytes); longer tracebacks are cut.
NOTICE_BYTES = 16384
_ACK_TAG = 78
_RELEASE_TAG = 79
#: Seconds a rank that failed waits for the others to report its failure before
#: it exits (its exit makes mpirun stop the job, maybe before they printed).
ACK_WAIT = 5.0
_STATE_TEXT = {SHUTDOWN: "called shutdown()", EXITED: "ended its script"}
#: What a rank in a collective step waits in (the argument of its IN_BARRIER wait).
_COLLECTIVES = ("barrier()", "the construction of a table")


class MpiWorld(TableWorld):
    """The ranks of an MPI job as Multiverso workers (see the module docstring)."""

    kind = "mpi"

    def __init__(self):
        MPI = launch.mpi()  # finalised by shutdown(), after the windows are freed
        self.MPI = MPI
        self._own_mpi = launch.mpi_started_here()
        world = MPI.COMM_WORLD
        self.comm = world.Dup()     # collectives and windows
        self.notices = launch.Notices(world.Dup(), NOTICE_BYTES)  # failure notices, acks
        self._fin = world.Dup()     # the final barrier, never matched by a user's barrier
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.prefix = ""
        self.closed = False
        self.failed = False
        self.stores: dict = {}
        # on rank 0: every rank's state, what it waits in, and for what (3 x size words)
        self._state_win = MPI.Win.Allocate(24 * self.size if self.rank == 0 else 0, disp_unit=1,
                                           comm=self.comm)
        if self.rank == 0:
            self._state_win.Lock(0, MPI.LOCK_EXCLUSIVE)
            words = np.frombuffer(self._state_win.tomemory(), dtype=np.int64)
            words[:] = NOT_WAITING
            words[:self.size] = RUNNING
            self._state_win.Unlock(0)
        self._words = np.zeros(3 * self.size, dtype=np.int64)
        self._states = self._words[:self.size]
        self._install_hooks()
        self._poll([self.comm.Ibarrier()], "init()")

    # -- failures ----------------------------------------------------------------

    def _install_hooks(self) -> None:
        previous = sys.excepthook

        def excepthook(tp, value, tb, _previous=previous):
            if not isinstance(value, WorkerFailedError) and not self.closed:
                self.record_failure(value)
            self.failed = True
            _previous(tp, value, tb)
            if isinstance(value, WorkerFailedError) and not self.closed:
                self._acknowledge(value.rank)
            elif not self.closed:
                self._await_acks()

        sys.excepthook = excepthook
        atexit.register(self._at_exit)

    def record_failure(self, exc: BaseException) -> None:
        """Tell every other rank that this one failed with ``exc``, with its traceback."""
        self.failed = True
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        message = f"{type(exc).__name__}: {exc}"
        self.notices.send((self.rank, message, text),
                          lambda v: (v[0], v[1][:500], "...\n" + v[2][-NOTICE_BYTES // 2:]))

    def _await_acks(self) -> None:
        """The failed rank: wait (a while) until every other rank has printed its report."""
        acks = [np.zeros(1, dtype=np.int8) for _ in range(self.size)]
        reqs = [self.notices.comm.Irecv([acks[r], self.MPI.BYTE], source=r, tag=_ACK_TAG)
                for r in range(self.size) if r != self.rank]
        self.notices.sent.append((acks, reqs))
        wait_until(lambda: self.MPI.Request.Testall(reqs), timeout=ACK_WAIT)
        # then let them all go at once: over TCP a rank that exits early breaks its
        # sockets, and MPI aborts a peer that has not printed its report yet
        one = np.ones(1, dtype=np.int8)
        sends = self.notices.to_others(one, _RELEASE_TAG)
        self.notices.sent.append((one, sends))
        wait_until(lambda: self.MPI.Request.Testall(sends), timeout=1.0)

    def _acknowledge(self, rank: int) -> None:
        """Tell the failed rank that this one has reported its failure."""
        sys.stderr.flush()
        buf = np.ones(1, dtype=np.int8)
        try:
            req = self.notices.comm.Isend([buf, self.MPI.BYTE], dest=rank, tag=_ACK_TAG)
        except Exception:  # noqa: BLE001 - it may be gone already
            return
        release = np.zeros(1, dtype=np.int8)
        wait = self.notices.comm.Irecv([release, self.MPI.BYTE], source=rank, tag=_RELEASE_TAG)
        self.notices.sent.append(((buf, release), [req, wait]))
        wait_until(lambda: self.MPI.Request.Testall([req, wait]), timeout=ACK_WAIT + 1.0)

    def check(self, what: str = "this call") -> None:
        """Raise :class:`WorkerFailedError` once another rank has sent a failure notice."""
        failure = self.notices.received(unreadable=("?", "(an unreadable failure notice)", ""))
        if failure is not None:
            self.failed = True
            rank, message, tb = failure
            raise raised_error(rank, self.size, message, tb, self.rank, what)

    def _poll(self, reqs, what: str, also=None, waiting=None) -> None:
        """Until every request completes; ``check`` (and ``also``) between slices."""
        Testall = self.MPI.Request.Testall
        self.wait_until(lambda: Testall(reqs), what, waiting, also)

    def _publish(self, kind: int, arg: int) -> None:
        MPI, win, n = self.MPI, self._state_win, self.size
        pair = np.array([kind, arg], dtype=np.int64)
        win.Lock(0, MPI.LOCK_SHARED)  # every rank writes only its own words
        win.Put([pair[:1], MPI.INT64_T], 0, target=(8 * (n + self.rank), 1, MPI.INT64_T))
        win.Put([pair[1:], MPI.INT64_T], 0, target=(8 * (2 * n + self.rank), 1, MPI.INT64_T))
        win.Unlock(0)

    def _deadlock(self, what: str, stuck: dict) -> None:
        """Raise when every working rank waits, and none of the waits can ever end."""
        n = self.size
        words = self.states().copy()
        waits, collectives = [], set()
        for r in range(n):
            if int(words[r]) in (SHUTDOWN, EXITED):
                continue
            kind, arg = int(words[n + r]), int(words[2 * n + r])
            if kind == NOT_WAITING:
                stuck["since"] = None
                return
            if kind == IN_BARRIER:
                collectives.add(arg)
            else:
                store = self.stores.get(arg >> 32)
                if store is None or store.win is None or store._all_reached(
                        0 if kind == IN_SYNC_GET else 1, arg & 0xFFFFFFFF):
                    stuck["since"] = None
                    return
            waits.append((r, kind, arg))
        if len(collectives) == 1 and all(k == IN_BARRIER for _, k, _ in waits):
            stuck["since"] = None  # everybody in the same collective: it will complete
            return
        if stuck_too_long(stuck, waits):
            raise deadlock_error(what, [(r, k, _COLLECTIVES[a] if k == IN_BARRIER else a)
                                        for r, k, a in waits])

    # -- states ----------------------------------------------------------------------

    def states(self) -> np.ndarray:
        MPI, win = self.MPI, self._state_win
        win.Lock(0, MPI.LOCK_SHARED)
        win.Get([self._words, MPI.INT64_T], 0, target=(0, 3 * self.size, MPI.INT64_T))
        win.Unlock(0)
        return self._words

    def finished(self, rank: int) -> bool:
        """True when ``rank`` will make no more table calls (shutdown or ended)."""
        return int(self._states[rank]) in (SHUTDOWN, EXITED)

    def _set_state(self, state: int) -> None:
        MPI, win = self.MPI, self._state_win
        value = np.array([state], dtype=np.int64)
        win.Lock(0, MPI.LOCK_SHARED)  # every rank writes only its own word
        win.Put([value, MPI.INT64_T], 0, target=(8 * self.rank, 1, MPI.INT64_T))
        win.Unlock(0)

    def _gone(self, what: str) -> None:
        states = self.states()
        for r in range(self.size):
            s = int(states[r])
            if r != self.rank and s in (SHUTDOWN, EXITED):
                raise SynkError(f"{what}: worker {r} of {self.size} {_STATE_TEXT[s]} and will never "
                                f"reach it (every worker must call {what} the same number of times)")

    # -- collective steps ----------------------------------------------------------------

    def barrier(self, what: str = "barrier()", meta=None):
        """Wait until every rank arrives. With ``meta`` (4 ints), return every rank's."""
        self.check(what)
        MPI = self.MPI
        if meta is None:
            self._poll([self.comm.Ibarrier()], what, self._gone, (IN_BARRIER, 0))
            return None
        mine = np.array(meta, dtype=np.int64)
        every = np.zeros((self.size, 4), dtype=np.int64)
        req = self.comm.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
        self._keep = (mine, every)
        self._poll([req], what, self._gone, (IN_BARRIER, 1))
        return [tuple(int(v) for v in row) for row in every]

    def bcast(self, array: np.ndarray, what: str) -> None:
        """Rank 0's ``array`` into every rank's ``array`` (same shape and dtype everywhere)."""
        self._poll([self.comm.Ibcast(array, root=0)], what, self._gone)

    def scatter_rows(self, full, part: np.ndarray, counts: list, mpitype, what: str) -> None:
        """Rank ``r``'s ``counts[r]`` values of rank 0's ``full``, in rank order, into its ``part``."""
        displs = [sum(counts[:r]) for r in range(len(counts))]
        send = [full, (counts, displs), mpitype] if self.rank == 0 else None
        self._poll([self.comm.Iscatterv(send, [part, mpitype], root=0)], what, self._gone)

    def new_store(self, index: int, num_row: int, num_col: int, dtype, init_value):
        """The storage of a new table (collective): a slice of rows on every rank."""
        store = MpiStore(self, index, num_row, num_col, dtype, init_value)
        self.stores[index] = store
        return store

    def shutdown(self) -> None:
        """Leave: wait for every rank (shutdown() or the end of its script), free every
        window, then finalise MPI."""
        self.check("shutdown()")
        self._finish(SHUTDOWN)

    def _finish(self, state: int) -> None:
        self._set_state(state)
        self._poll([self._fin.Ibarrier()], "shutdown()")
        self._free()

    def _free(self) -> None:
        if self.closed:
            return
        self.closed = True
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        self._state_win.Free()
        self.notices.close()
        for c in (self.comm, self._fin):
            c.Free()
        if self._own_mpi:
            self.MPI.Finalize()

    def _at_exit(self) -> None:
        if self.closed:
            return
        if self.failed:
            # others may be inside a collective that can never finish: no collective
            # clean-up; mpirun reports the non-zero exit and stops the job
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        try:
            self._finish(EXITED)
        except BaseException as err:  # noqa: BLE001 - at exit there is nobody to raise to
            sys.stderr.write(f"synkhronos.multiverso: {err}\n")
            sys.stderr.flush()
            os._exit(1)


#: The most values one MPI call moves (a C int count, MPI 3.1).
_MAX_COUNT = 2 ** 31 - 1


class MpiStore:
    """One table split over the ranks, in one MPI window (see the module docstring).

    Collective: every rank constructs it at the same time.
    """

    def __init__(self, world: MpiWorld, index: int, num_row: int, num_col: int, dtype,
                 init_value=None):
        MPI = world.MPI
        self.world = world
        self.MPI = MPI
        self.index = index
        self.shape = (num_row, num_col)
        self.dtype = np.dtype(dtype)
        self.mpitype = MPI.FLOAT if self.dtype == np.float32 else MPI.DOUBLE
        n = world.size
        meta = (index, num_row, num_col, self.dtype.num)
        metas = world.barrier(f"constructing table {index}", meta)
        for r, m in enumerate(metas):
            if m != meta:
                raise ValueError(
                    f"every worker must construct the same tables in the same order: table {index} "
                    f"is {describe_table(meta)} on worker {world.rank} but {describe_table(m)} on worker {r}")
        if num_row * num_col > _MAX_COUNT:  # the same on every rank: every rank raises
            raise ValueError(
                f"table {index} ({describe_table(meta)}) holds {num_row * num_col:,} values; under MPI "
                f"its init_value, gets and adds move up to a whole table or a rank's share in one MPI "
                f"call, whose counts are C ints (MPI 3.1, as the Open MPI 5 wheel speaks): at most "
                f"{_MAX_COUNT:,} values a table. Split it into several tables")
        self.bounds = [(num_row * r // n, num_row * (r + 1) // n) for r in range(n)]
        self.head = 16 * n  # rank 0 only: the sync server's counters (int64 arrived, copied)
        self.row_bytes = num_col * self.dtype.itemsize
        a, b = self.bounds[world.rank]
        base = self.head if world.rank == 0 else 0
        self.win = MPI.Win.Allocate(base + (b - a) * self.row_bytes, disp_unit=1, comm=world.comm)
        mem = np.frombuffer(self.win.tomemory(), dtype=np.uint8)
        flag = np.array([init_value is not None], dtype=np.int8)
        world.bcast(flag, f"constructing table {index}")
        part = None
        if flag[0]:  # rank 0's value, each rank receiving its own rows only
            full = (np.ascontiguousarray(init_value, dtype=self.dtype).reshape(self.shape)
                    if world.rank == 0 else None)
            part = np.empty((b - a, num_col), dtype=self.dtype)
            world.scatter_rows(full, part, [(hi - lo) * num_col for lo, hi in self.bounds],
                               self.mpitype, f"constructing table {index}")
        self.win.Lock(world.rank, MPI.LOCK_EXCLUSIVE)
        mem[:] = 0
        if part is not None and b > a:
            mem[base:].view(self.dtype).reshape(b - a, num_col)[:] = part
        self.win.Unlock(world.rank)
        world.barrier(f"constructing table {index}")
        self._counts = np.zeros(2 * n, dtype=np.int64)
        self._start = world.rank

    def _disp(self, owner: int, row: int) -> int:
        return (self.head if owner == 0 else 0) + (row - self.bounds[owner][0]) * self.row_bytes

    def _owners(self):
        n = self.world.size
        return [(self._start + i) % n for i in range(n)]

    # -- data --------------------------------------------------------------------------

    def add(self, data: np.ndarray, rows: np.ndarray | None) -> None:
        """``table += data`` (all rows) or ``table[rows] += data`` (``rows`` sorted, unique)."""
        MPI, win, t, cols = self.MPI, self.win, self.mpitype, self.shape[1]
        for owner in self._owners():
            a, b = self.bounds[owner]
            if rows is None:
                runs = [(a, b, a)] if b > a else []
            else:
                runs = _runs(rows, a, b)
            if not runs:
                continue
            win.Lock(owner, MPI.LOCK_SHARED)
            for lo, hi, first in runs:
                # rows [lo, hi) of the table <- rows [first, first + hi - lo) of data
                src = data[first:first + hi - lo] if rows is not None else data[lo:hi]
                win.Accumulate([src, t], owner, target=(self._disp(owner, lo), (hi - lo) * cols, t),
                               op=MPI.SUM)
            win.Unlock(owner)

    def get(self, out: np.ndarray, rows: np.ndarray | None) -> None:
        """Copy all rows (or ``rows``, any order, repeats allowed) into ``out``."""
        MPI, win, t, cols = self.MPI, self.win, self.mpitype, self.shape[1]
        if rows is None:
            direct = out.flags.c_contiguous
            for owner in self._owners():
                a, b = self.bounds[owner]
                if b == a:
                    continue
                dest = out[a:b] if direct else np.empty((b - a, cols), dtype=self.dtype)
                win.Lock(owner, MPI.LOCK_SHARED)
                win.Get([dest, t], owner, target=(self._disp(owner, a), (b - a) * cols, t))
                win.Unlock(owner)
                if not direct:
                    out[a:b] = dest
            return
        # each requested row once, in runs of consecutive rows: only those travel
        uniq, inverse = np.unique(rows, return_inverse=True)
        buf = np.empty((len(uniq), cols), dtype=self.dtype)
        for owner in self._owners():
            a, b = self.bounds[owner]
            runs = _runs(uniq, a, b)
            if not runs:
                continue
            win.Lock(owner, MPI.LOCK_SHARED)
            for lo, hi, first in runs:
                win.Get([buf[first:first + hi - lo], t], owner, target=(self._disp(owner, lo), (hi - lo) * cols, t))
            win.Unlock(owner)
        out[...] = buf[inverse.reshape(-1)]

    def flush(self) -> None:
        """Adds complete at their Unlock: nothing to wait for."""

    # -- sync server ----------------------------------------------------------------------

    def _read_counts(self) -> np.ndarray:
        MPI, win = self.MPI, self.win
        win.Lock(0, MPI.LOCK_SHARED)
        win.Get([self._counts, MPI.INT64_T], 0, target=(0, 2 * self.world.size, MPI.INT64_T))
        win.Unlock(0)
        return self._counts

    def _write_count(self, which: int, count: int) -> None:
        MPI, win = self.MPI, self.win
        value = np.array([count], dtype=np.int64)
        win.Lock(0, MPI.LOCK_SHARED)  # every rank writes only its own words
        win.Put([value, MPI.INT64_T], 0, target=(8 * (which * self.world.size + self.world.rank), 1,
                                                  MPI.INT64_T))
        win.Unlock(0)

    def _all_reached(self, which: int, count: int) -> bool:
        world, n = self.world, self.world.size
        counts = self._read_counts()[which * n:(which + 1) * n]
        if all(counts >= count):
            return True
        world.states()
        return all(counts[s] >= count or world.finished(s) for s in range(n))

    def before_get(self, count: int) -> None:
        """Sync server: wait until every worker still working issued its ``count``-th get."""
        self._write_count(0, count)
        self.world.wait_until(lambda: self._all_reached(0, count), "get() (sync server)",
                              (IN_SYNC_GET, (self.index << 32) | count))

    def after_get(self, count: int) -> None:
        self._write_count(1, count)

    def before_add(self, count: int) -> None:
        """Sync server: an add after this worker's ``count``-th get waits until every worker
        has taken its ``count``-th value."""
        if count:
            self.world.wait_until(lambda: self._all_reached(1, count), "add() (sync server)",
                                  (IN_SYNC_ADD, (self.index << 32) | count))

    def close(self) -> None:
        """Free the window (collective: every rank does it at shutdown)."""
        if self.win is not None:
            self.win.Free()
            self.win = None


def _runs(rows: np.ndarray, a: int, b: int):
    """Runs of consecutive ``rows`` inside ``[a, b)``: ``(first row, end row, index in rows)``."""
    lo, hi = np.searchsorted(rows, a), np.searchsorted(rows, b)
    if lo == hi:
        return []
    sub = rows[lo:hi]
    cuts = np.flatnonzero(np.diff(sub) != 1) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(sub)]))
    return [(int(sub[s]), int(sub[e - 1]) + 1, lo + int(s)) for s, e in zip(starts, stops)]
