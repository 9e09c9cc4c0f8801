"""The creator of a control block or communicator removes its own semaphores.

posix_ipc refuses to unlink a semaphore that was closed first; the fork's
final sweep of its prefix used to hide that every semaphore was left for it.
"""

from __future__ import annotations

import os

from synkhronos.collectives.shm import ShmCommunicator
from synkhronos._protocol.control import ControlBlock
from synkhronos._procs.shmem import new_prefix, unlink_prefix


def _names(prefix):
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith("sem." + prefix))


def test_creators_unlink_their_own_semaphores_and_segments():
    prefix = new_prefix()
    try:
        ctl = ControlBlock(prefix, 3, 0, True)
        comm = ShmCommunicator(prefix, 0, 3, 0, True)
        assert any(n.startswith("sem.") for n in _names(prefix))
        comm.close()
        ctl.close()
        assert _names(prefix) == []
    finally:
        unlink_prefix(prefix)
