"""The worker loop: receive a command, run its handler, report back."""

from __future__ import annotations

import logging
import os
import signal
from functools import partial
from typing import Any, Callable

from .control import Command
from .data_refs import forget
from .distribute import receive as receive_functions
from .._function.spec import LocalFunction
from .._function.worker import worker_call
from .._kept.plans import publish_homes
from .._shareds.host import worker_collective
from ..errors import Aborted, Interrupted, MasterGone, as_interrupt, pack_exception
from .._procs.waits import wait_until
from .._procs.shmem import unlink_prefix

__all__ = ["serve", "serve_profiled"]

log = logging.getLogger("synkhronos")


def serve_profiled(proc, directory: str) -> int:
    """:func:`serve` under cProfile; the stats go to ``directory/synk_worker_<rank>.prof``
    when the worker leaves (fork(profile_workers=...))."""
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(serve, proc)
    finally:
        path = os.path.join(directory, f"synk_worker_{proc.rank}.prof")
        try:
            profiler.dump_stats(path)
        except OSError as exc:
            log.warning("rank %d could not write its profile to %s: %s", proc.rank, path, exc)


def _open_device(proc, msg) -> None:
    """INIT_DEVICE: this process opens its device (GPU: the GPU, then NCCL)."""
    proc.device.open(proc, msg)


#: The worker half of every command: ``HANDLERS[cmd](proc, payload)``.
HANDLERS: dict[Command, Callable[[Any, Any], Any]] = {
    Command.DISTRIBUTE: partial(receive_functions, make_local=LocalFunction),
    Command.CALL: worker_call,
    Command.COLLECTIVE: worker_collective,
    Command.INIT_DEVICE: _open_device,
}


def serve(proc) -> int:
    """Serve commands until CLOSE; returns the exit code."""
    ctl = proc.control
    epoch = ctl.epoch()
    try:
        while True:
            cmd, message = ctl.receive(proc.rank, proc.check_parent)
            if cmd is Command.CLOSE:
                return 0
            dropped, payload = message
            forget(proc, dropped)
            if ctl.epoch() != epoch:  # the master reset the communicator after a failure
                epoch = ctl.epoch()
                proc.comm.local_reset()
            error = None
            try:
                HANDLERS[cmd](proc, payload)
            except MasterGone:
                raise
            except BaseException as exc:
                if isinstance(as_interrupt(exc), Interrupted):  # the master abandoned the command
                    exc = Aborted(f"rank {proc.rank} stopped: the master abandoned the command")
                error = pack_exception(exc, proc.rank)
            publish_homes(proc)  # where its values live now, for the master between commands
            ctl.reply(proc.rank, error)
    except MasterGone:
        # No further signal may break off the cleanup (a parent-death signal
        # that follows a noticed reparenting, a SIGTERM from the group).
        # Blocking them would not do: a native thread of this process would
        # take them and Python would still run the handler here.
        while True:
            try:
                _quiet_signals()
                break
            except MasterGone:
                continue
        # Whoever of the fork leaves last unlinks: the lock tells whether any
        # other process of it (the master included) is still alive.
        if _last_out(proc):
            unlink_prefix(proc.prefix)
        return 1
    finally:
        try:
            proc.close()
        except Exception:
            pass


def _quiet_signals() -> None:
    """Ignore every signal that has a Python handler from now on."""
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):
            pass


def _last_out(proc) -> bool:
    """True when no other process of the fork is alive any more.

    Once the master is dead, a lock still held may be one that is being let
    go of (a process that just died, or one that tried and is leaving): ask
    again for a short while. Every process that asked is leaving, so a later
    success is still proof.
    """
    if proc.lease is None:
        return False
    if not proc.master_died():
        return proc.lease.last_out()
    return wait_until(proc.lease.last_out, timeout=0.5, spin=0.0, first_sleep=0.01, max_sleep=0.01)
