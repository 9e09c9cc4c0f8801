"""Signals: the workers' handlers, and the master's clean-up before it dies of one.

A worker ends when its master dies (a parent-death signal of its own), dies
of a terminating signal only where its master would, and stops a computation
the master abandoned (the interrupt signal). The master, where it leaves a
terminating signal at its default, kills and reaps its workers and unlinks
the fork's shared memory before it dies of it. The flags the handlers set
live in :data:`synkhronos._state.signal_state`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from .. import _state
from ..errors import Interrupted, MasterGone
from .children import PARENT_DEATH_SIGNAL, die_of
from .shmem import unlink_prefix

__all__ = []

#: Sent by the master to a worker still busy with a command it abandoned
#: (Ctrl-C, a timeout, close()): the worker's computation stops at its next
#: Python step. A signal of synkhronos's own, so a user's SIGINT or SIGUSR1
#: means to a worker what the master's disposition says.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 8
#: Signals whose default action ends a process, as a terminal (hangup, Ctrl-C,
#: Ctrl-backslash), ``timeout``, ``kill`` or a batch scheduler sends them, often to the
#: whole process group. Where the master leaves one at its default, fork()
#: makes it clean up first (end the workers, unlink the shared memory), then
#: die of it as before; where the user handles one, the workers ignore it and
#: the master's handler decides.
FATAL_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name))


def worker_signals() -> None:  # pragma: no cover - worker only
    """A worker dies of a signal only where its master would: it ignores Ctrl-C
    (the master abandons the command and interrupts it) and the signals the
    user handles in the master."""
    for sig in FATAL_SIGNALS:
        if sig != signal.SIGINT and _state.signal_state.dispositions.get(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_terminate)
        else:
            signal.signal(sig, signal.SIG_IGN)
    signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death)
    signal.signal(INTERRUPT_SIGNAL, _on_interrupt)


def _on_parent_death(signum, frame):  # pragma: no cover - worker only
    state = _state.signal_state
    state.master_died = state.terminate_requested = True
    raise MasterGone()


def _on_terminate(signum, frame):  # pragma: no cover - worker only
    # posix_ipc turns an exception raised in a handler during a semaphore wait
    # into SignalError (which the wait retries): the flag makes the next
    # liveness check end the worker all the same
    _state.signal_state.terminate_requested = True
    _state.signal_state.terminate_signal = signum
    raise MasterGone()


def _on_interrupt(signum, frame):  # pragma: no cover - worker only
    # only inside the computation, and only while the master has abandoned the
    # command: a late signal must not stop the next one
    interruptible = _state.interruptible
    if interruptible.armed and interruptible.control is not None and interruptible.control.aborted():
        interruptible.armed = False
        raise Interrupted("the master abandoned this command")


def install_master_handlers() -> dict:
    """Make the master clean up before it dies of a signal left at its default action."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return saved  # signal handlers can only be set from the main thread
    for sig in FATAL_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_fatal_signal)
            saved[sig] = signal.SIG_DFL
    return saved


def restore_master_handlers(saved: dict) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # left in place: with no fork running it only re-raises the signal
    for sig, old in saved.items():
        if signal.getsignal(sig) is _on_fatal_signal:
            signal.signal(sig, old)


def _on_fatal_signal(signum, frame):
    """The master received a signal that ends it: end the workers, unlink, then die of it."""
    s = _state.current()
    if s is not None and os.getpid() == s.pid:
        emergency_cleanup(s)
    die_of(signum)


def emergency_cleanup(s) -> None:
    """The master is about to die: no protocol, kill and reap the workers, unlink everything."""
    s.watch.kill_now()
    unlink_prefix(s.proc.prefix)
