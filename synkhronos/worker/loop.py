"""The worker loop: receive a command, run its handler, report back."""

from __future__ import annotations

import logging
import os

from ..data import forget
from ..control import Aborted, Command, Interrupted, MasterGone, as_interrupt, handlers
from ..errors import pack_exception
from ..shmem import unlink_prefix

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


def serve(proc) -> int:
    """Serve commands until CLOSE; returns the exit code."""
    # The feature modules register their worker-side handlers on import.
    from .. import distribute, function, gpu, shareds  # noqa: F401

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
                handlers[cmd](proc, payload)
            except MasterGone:
                raise
            except BaseException as exc:
                if isinstance(as_interrupt(exc), Interrupted):  # the master abandoned the command
                    exc = Aborted(f"rank {proc.rank} stopped: the master abandoned the command")
                error = pack_exception(exc, proc.rank)
            ctl.reply(proc.rank, error)
    except MasterGone:
        # Whoever of the fork leaves last unlinks: the lock tells whether any
        # other process of it (the master included) is still alive.
        if proc.lease is not None and proc.lease.last_out():
            unlink_prefix(proc.prefix)
        return 1
    finally:
        try:
            proc.close()
        except Exception:
            pass
