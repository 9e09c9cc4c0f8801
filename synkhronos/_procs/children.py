"""The processes this one forked (:class:`Children`: fork, reap, signal and end
them by rank), and the parent-death signal every child arms (:func:`die_of`)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterable

from ..errors import WorkerDiedError
from .waits import wait_until

__all__ = []

log = logging.getLogger("synkhronos")

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

    def spawn(self, ranks: Iterable[int], in_child: Callable[[int], object]) -> int | None:
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

    def signal(self, sig: int, ranks: Iterable[int] | None = None) -> None:
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


