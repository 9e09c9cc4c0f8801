"""The process group under the runtime and the parameter server: what
``synk.fork()`` and ``multiverso.init()`` share, once.

- **waiting**: :func:`wait_until`, the one poll-with-backoff of every wait;
- **children**: :class:`Children` forks, reaps, signals and ends them, by rank;
- **signals**: the parent-death signal every child arms, and :func:`die_of`;
- **liveness**: :class:`Lease`, the group's lock file: the last one out knows
  it is last, a dead group's names are reclaimed (:func:`unlink_stale`), and a
  rank's byte of it tells whether that rank lives;
- **launchers and MPI**: :func:`launched`, :func:`mpi` (the one bootstrap)
  and :class:`Notices` (the one failure channel between MPI processes).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
import warnings

import numpy as np
import posix_ipc

from .. import _state as context
from ..errors import WorkerDiedError
from .shmem import SHM_DIR, LOCK_NAME, known_prefixes, new_prefix, unlink_prefix

__all__ = []

log = logging.getLogger("synkhronos")

# -- waiting ------------------------------------------------------------------

#: Seconds a wait polls, yielding the core at each turn, before it sleeps.
SPIN = 1e-3
#: Shortest and longest sleep between polls once the spin is over (seconds).
FIRST_SLEEP = 50e-6
MAX_SLEEP = 2e-3
#: Seconds between two runs of a wait's check.
CHECK_EVERY = 0.05


def wait_until(ready, check=None, *, timeout: float | None = None, spin: float = SPIN,
               check_every: float = CHECK_EVERY, first_sleep: float = FIRST_SLEEP,
               max_sleep: float = MAX_SLEEP, block=None, clock_every: int = 1) -> bool:
    """Wait until ``ready()``; True then, False once ``timeout`` seconds passed.

    Polls for ``spin`` seconds, yielding the core at each turn (the process
    waited for may need it); then sleeps between polls, ``first_sleep``
    doubling up to ``max_sleep``, or calls ``block()`` (a blocking wait of
    one slice, True once ready). ``check()`` runs every ``check_every``
    seconds and raises to end the wait; ``clock_every=n``: the spin reads the
    clock at every n-th turn only."""
    if ready():
        return True
    clock = time.perf_counter
    start = clock()
    next_check = start + check_every
    end = None if timeout is None else start + timeout
    sleep = first_sleep
    turns, mask = 0, clock_every - 1  # a power of two: the clock at every clock_every-th turn
    while True:
        os.sched_yield()
        if ready():
            return True
        turns += 1
        if turns & mask:
            continue
        now = clock()
        if now - start < spin:
            if check is not None and now >= next_check:
                next_check = now + check_every
                check()
            continue
        while True:  # the spin is over: sleep or block between polls
            if check is not None and now >= next_check:
                next_check = now + check_every
                check()
            if end is not None and now >= end:
                return False
            if block is not None:
                if block():
                    return True
            else:
                time.sleep(sleep if end is None else max(0.0, min(sleep, end - now)))
                sleep = min(sleep * 2, max_sleep)
                if ready():
                    return True
            now = clock()


def take(sem) -> bool:
    """Take a token of the POSIX semaphore ``sem`` if one is there now."""
    try:
        sem.acquire(0)
        return True
    except posix_ipc.BusyError:
        return False


def block_on(sem, seconds: float):
    """``block`` for :func:`wait_until`: up to ``seconds`` for a token of ``sem`` (a
    signal that interrupts it counts as a slice without one)."""
    def block() -> bool:
        try:
            sem.acquire(seconds)
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False

    return block


# -- signals ------------------------------------------------------------------

#: Sent to a child of the group when its parent dies: a signal of its own, because
#: the kernel may deliver it before the child is reparented (getppid() then still
#: names the dead parent), and a SIGTERM may also come from the user or close().
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 7
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """Arm :data:`PARENT_DEATH_SIGNAL` in this (forked) process."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux: the liveness checks still catch a dead parent
        pass


def die_of(signum: int) -> None:
    """End this process by ``signum`` at its default action (its exit status says
    so); ``os._exit(128 + signum)`` where that does not end it."""
    try:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)


# -- children -----------------------------------------------------------------


#: Python 3.12's warning on os.fork() in a process that has threads: the
#: master always has some (its BLAS and OpenMP pools, idle between calls),
#: and forking with them is what synkhronos has always done.
FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"


class Children:
    """The processes this one forked: ``pids`` (rank -> pid) and ``exited`` (rank ->
    exit status, ``-signal`` for a signal, None when reaped elsewhere)."""

    def __init__(self, pids: dict[int, int] | None = None):
        self.pids = dict(pids or {})
        self.exited: dict[int, int | None] = {}

    def spawn(self, ranks, in_child) -> int | None:
        """Fork one child per rank of ``ranks``; each runs ``in_child(rank)``, then
        returns its rank from here (None in this process)."""
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in ranks:
            with warnings.catch_warnings():  # Python 3.12+: see FORK_WARNING
                warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                in_child(rank)
                return rank
            self.pids[rank] = pid
        return None

    def reap(self) -> dict:
        """Collect the children that ended since the last call: rank -> exit status."""
        new = {}
        for rank, pid in self.pids.items():
            if rank in self.exited:
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, None
            if done:
                self.exited[rank] = new[rank] = None if status is None else os.waitstatus_to_exitcode(status)
        return new

    def poll(self) -> None:
        """Raise :class:`~synkhronos.errors.WorkerDiedError` (the lowest rank) once a child ended."""
        self.reap()
        if self.exited:
            rank = min(self.exited)
            raise WorkerDiedError(rank, self.exited[rank])

    def alive(self) -> dict[int, int]:
        """rank -> pid of every child not yet seen to end."""
        return {r: p for r, p in self.pids.items() if r not in self.exited}

    def signal(self, sig: int, ranks=None) -> None:
        """Send ``sig`` to the children of ``ranks`` (default: every one still alive)."""
        for rank in (self.alive() if ranks is None else ranks):
            pid = self.pids.get(rank)
            if pid is None or rank in self.exited:
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, seconds: float) -> bool:
        """Reap until every child has ended (True) or ``seconds`` have passed (False)."""
        return wait_until(lambda: not self.reap() and not self.alive(), timeout=seconds, spin=0.0)

    def end(self, grace: float, interrupts: list | None = None) -> None:
        """Wait ``grace`` seconds for every child to end, then SIGTERM, then SIGKILL
        the ones that do not. A Ctrl-C meanwhile (kept in ``interrupts``) goes
        straight to SIGKILL."""
        ladder = ((None, grace), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0))
        stage = 0
        while self.alive() and stage < len(ladder):
            sig, seconds = ladder[stage]
            try:
                if sig is not None:
                    for rank, pid in self.alive().items():
                        log.warning("worker rank %d (pid %d) did not exit; sending %s", rank, pid, sig.name)
                    self.signal(sig)
                self.wait(seconds)
                stage += 1
            except KeyboardInterrupt as err:
                if interrupts is None:
                    raise
                interrupts.append(err)
                stage = len(ladder) - 1

    def kill_now(self, seconds: float = 5.0) -> None:
        """SIGKILL every child still alive and reap them (for a process about to die)."""
        self.signal(signal.SIGKILL)
        self.wait(seconds)


# -- liveness -------------------------------------------------------------------

#: struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (64-bit off_t).
_FLOCK = struct.Struct("hhqqi4x")


class Lease:
    """This process's hold on its group's lock file, ``<prefix>lock`` in /dev/shm.

    Every live process of the group holds a shared ``flock`` on it (through a
    descriptor of its own); the kernel drops it at death, however it comes, so
    the names are stale exactly when an exclusive lock can be taken (a pid is
    no proof: PID namespaces share /dev/shm). A process may also hold its
    rank's byte (``lockf``: never inherited, dropped at death)."""

    __slots__ = ("prefix", "fd")

    def __init__(self, prefix: str, create: bool = False):
        self.prefix = prefix
        path = os.path.join(SHM_DIR, prefix + LOCK_NAME)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)
        except OSError as err:  # a stale-name cleanup elsewhere took it between open and lock
            os.close(fd)
            raise OSError(f"the synkhronos lock file {path} was removed by another process") from err
        self.fd = fd

    @classmethod
    def new(cls) -> "Lease":
        """The lease of a new group, under a fresh prefix (created first, unlinked
        last), once the names of groups no longer alive are reclaimed."""
        stale = unlink_stale()
        if stale:
            log.info("removed %d shared-memory objects left by synkhronos processes no longer alive",
                     len(stale))
        error = None
        for _ in range(8):  # a stale-name cleanup elsewhere may catch it before it is locked
            try:
                return cls(new_prefix(), create=True)
            except OSError as err:
                error = err
        raise error

    def hold(self, rank: int) -> None:
        """Hold this process's rank byte (see the class docstring)."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)

    def let_go(self, rank: int) -> None:
        """Drop this process's rank byte: the others now see it gone."""
        if self.fd is not None:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, rank)
            except OSError:
                pass

    def alive(self, rank: int) -> bool:
        """Whether the process of ``rank`` holds its byte (F_GETLK: a probe that took
        the byte, even for a moment, would make a second prober believe it alive)."""
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, rank, 1, 0)
        reply = fcntl.fcntl(self.fd, fcntl.F_GETLK, query)
        return _FLOCK.unpack(reply)[0] != fcntl.F_UNLCK

    def last_out(self) -> bool:
        """True when no other process holds the group's lock (this one may unlink);
        of several that ask at once one gets True (a failed try drops its lock)."""
        if self.fd is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def unlink_stale() -> list[str]:
    """Remove the names of groups none of whose processes is alive (a lock file that
    nobody holds); names without a lock file are left alone."""
    removed = []
    for prefix in known_prefixes():
        path = os.path.join(SHM_DIR, prefix + LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    continue
            except OSError:  # held: a process of that group is alive
                continue
            removed.extend(unlink_prefix(prefix))
        finally:
            os.close(fd)
    return removed


# -- launchers and MPI ----------------------------------------------------------

#: Environment variables a launcher sets in every copy it starts (Open MPI,
#: MPICH/Hydra and Intel MPI, PMIx and PMI-2 launchers, ``srun --mpi=...``).
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")
#: ``SYNKHRONOS_NODES=0`` keeps a launched copy to itself (no MPI at all).
SWITCH = "SYNKHRONOS_NODES"


def launched() -> bool:
    """Whether an MPI launcher started this process (and joining is not switched off)."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "no", "false", "off"):
        return False
    return any(os.environ.get(v) for v in LAUNCHER_VARS)


@functools.cache
def _import_mpi4py():
    """mpi4py's ``MPI`` module, imported without initialising MPI (the one import of it)."""
    try:
        import mpi4py
    except ImportError as err:
        found = [v for v in LAUNCHER_VARS if os.environ.get(v)]
        raise ImportError(f"synkhronos: an MPI launcher started this process ({', '.join(found) or 'MPI'} "
                          "is set), and joining the other copies needs mpi4py: pip install "
                          "'synkhronos[mpi]' (mpi4py for the site's MPI) or 'synkhronos[mpi-wheel]' "
                          f"(with Open MPI's wheel); or set {SWITCH}=0 to run each copy on its "
                          "own") from err

    mpi4py.rc.initialize = False  # initialised below, after any fork; never at import
    mpi4py.rc.finalize = False    # finalised by its user, after what it allocated is freed
    from mpi4py import MPI  # only here: importing the package never imports mpi4py

    return MPI


class _Start:
    """MPI_Init, run in a thread of its own: it returns only once every copy of the
    job has called it, so a copy still loading its data (or one that never calls
    it) would hold this one inside C for as long as it lives, deaf to signals and
    to any timeout. The caller's thread waits instead, in Python. Its state is
    ``context.mpi_start``.

    mpi4py's ``Init_thread`` keeps the GIL while MPI_Init waits (the waiting
    thread could not run), so the thread calls MPI's C function through ctypes,
    which lets the GIL go, then makes MPI's errors exceptions as mpi4py's own
    start does. Where MPI's library cannot be found, mpi4py's call is made in
    the caller's thread (without a bound)."""

    @staticmethod
    def library():
        """MPI's shared library loaded with mpi4py (None if not found)."""
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "/libmpi" in line and ".so" in line}
        except OSError:
            return None
        for path in sorted(paths):
            if os.path.basename(path).startswith(("libmpi.so", "libmpich.so", "libmpi_mt.so")):
                try:
                    lib = ctypes.CDLL(path)
                    lib.MPI_Init_thread  # noqa: B018 - present?
                    return lib
                except (OSError, AttributeError):
                    continue
        return None

    @staticmethod
    def run(lib, required: int, state: dict) -> None:
        try:
            provided = ctypes.c_int(0)
            code = lib.MPI_Init_thread(None, None, ctypes.c_int(required), ctypes.byref(provided))
            if code != 0:
                state["error"] = RuntimeError(f"MPI_Init_thread failed with MPI error code {code}")
            state["provided"] = provided.value
        except BaseException as err:  # noqa: BLE001 - raised in the waiting thread
            state["error"] = err


def mpi(timeout: float | None = None, check=None):
    """mpi4py's ``MPI`` module, MPI initialised (``THREAD_SERIALIZED``) at the first call.

    Many MPI transports break in a process that forks after ``MPI_Init``: call
    it only once every fork is done. Finalising is the caller's.

    MPI_Init runs in a thread of its own; the calling thread waits for it,
    calling ``check()`` between slices (signals are handled meanwhile), for at
    most ``timeout`` seconds (None: as long as it takes).

    Raises:
        ImportError: mpi4py is not installed (the message says what to install).
        TimeoutError: MPI did not start within ``timeout`` (the other copies of
            the job had not all called it); a later call waits again.
    """
    MPI = _import_mpi4py()
    st = context.mpi_start
    if st["ours"] is None and st["thread"] is None:
        if MPI.Is_initialized():
            st["ours"] = False
        else:
            lib = _Start.library()
            if lib is None:
                MPI.Init_thread(MPI.THREAD_SERIALIZED)
                st["ours"] = True
                return MPI
            st["thread"] = threading.Thread(target=_Start.run, args=(lib, MPI.THREAD_SERIALIZED, st),
                                            name="synkhronos-mpi-init", daemon=True)
            st["thread"].start()
    thread = st["thread"]
    if thread is not None:
        if not wait_until(lambda: not thread.is_alive(), check, timeout=timeout, max_sleep=0.01):
            raise TimeoutError(f"MPI_Init did not complete within {timeout} s")
        if st["error"] is not None:
            raise st["error"]
        if st.get("provided", MPI.THREAD_SERIALIZED) < MPI.THREAD_SERIALIZED:
            # (MPI's own level: FUNNELED would allow calls from MPI_Init's thread only)
            warnings.warn(f"synkhronos: this MPI gives thread level {st['provided']}, below "
                          "MPI_THREAD_SERIALIZED, which synkhronos asks for (MPI_Init ran in a thread "
                          "of its own; MPI is then called from the main thread)", stacklevel=2)
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):  # as mpi4py's own start: errors raise
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        st["thread"], st["ours"] = None, True
    return MPI


def mpi_started_here() -> bool:
    """Whether :func:`mpi` initialised MPI (rather than the script, before it)."""
    mpi()
    return bool(context.mpi_start["ours"])


class Notices:
    """The failure channel between the processes of an MPI communicator ``comm``
    (a duplicate it owns): a process that fails sends one notice to every other,
    which find it with :meth:`received` between polls. Never a blocking call."""

    TAG = 7

    def __init__(self, comm, limit: int):
        MPI = mpi()
        self.comm = comm
        self.limit = limit
        self._buf = np.zeros(limit, dtype=np.uint8)
        self._recv = comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=self.TAG)
        self._got = None
        self.sent: list = []  # (buffers, requests): MPI may use the buffers until close()

    def send(self, value, shorter) -> None:
        """Send ``value`` to every other process; ``shorter(value)`` stands in for a
        value that pickles to more than ``limit`` bytes."""
        blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        if len(blob) > self.limit:
            blob = pickle.dumps(shorter(value), protocol=pickle.HIGHEST_PROTOCOL)[:self.limit]
        buf = np.frombuffer(blob, dtype=np.uint8)
        self.sent.append((buf, self.to_others(buf, self.TAG)))

    def to_others(self, buf, tag: int) -> list:
        """Non-blocking sends of ``buf`` to every other process (one already gone is skipped)."""
        MPI, comm = mpi(), self.comm
        reqs = []
        for r in range(comm.Get_size()):
            if r != comm.Get_rank():
                try:
                    reqs.append(comm.Isend([buf, MPI.BYTE], dest=r, tag=tag))
                except Exception:  # noqa: BLE001 - a process already gone needs no notice
                    pass
        return reqs

    def received(self, unreadable=None):
        """The notice another process sent, once it has arrived (None until then;
        ``unreadable`` for one that does not unpickle)."""
        if self._got is None and self._recv is not None and self._recv.Test():
            self._recv = None
            try:
                self._got = pickle.loads(self._buf.tobytes())
            except Exception:  # noqa: BLE001 - a cut notice names nothing better
                self._got = unreadable
        return self._got

    def close(self) -> None:
        """Cancel the receive, give the sends a moment, free the communicator."""
        MPI = mpi()
        try:
            if self._recv is not None and not self._recv.Test():
                self._recv.Cancel()
                wait_until(self._recv.Test, timeout=5.0, spin=0.0)
        except Exception:  # noqa: BLE001 - unusable after a failure: local release only
            pass
        reqs = [r for _, sent in self.sent for r in sent]
        try:
            wait_until(lambda: MPI.Request.Testall(reqs), timeout=1.0, spin=0.0)
        except Exception:  # noqa: BLE001
            pass
        self._recv = None
        self.sent = []
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - freed or unusable after a failure
            pass
