"""The worker loop: receive a command, run its handler, report back."""

from __future__ import annotations

import logging

from ..data import forget
from ..control import Command, MasterGone, handlers
from ..errors import pack_exception
from ..shmem import unlink_prefix

__all__ = ["serve"]

log = logging.getLogger("synkhronos")


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
                error = pack_exception(exc, proc.rank)
            ctl.reply(proc.rank, error)
    except MasterGone:
        if proc.master_died():
            # Nobody else will clean up after a master that died.
            unlink_prefix(proc.prefix)
        return 1
    finally:
        try:
            proc.close()
        except Exception:
            pass
