"""Communicators: one interface, one class per backend."""

from .base import Communicator
from .ops import REDUCE_OPS, check_op
from .shm import PeerFailed, ShmCommunicator

__all__ = ["Communicator", "ShmCommunicator", "PeerFailed", "REDUCE_OPS", "check_op", "BACKENDS"]

#: backend name -> Communicator class; the GPU backend registers itself here.
BACKENDS = {"shm": ShmCommunicator}

try:  # the module imports CuPy only when a communicator is made
    from .nccl import NcclCommunicator
except ImportError:  # pragma: no cover - a broken install of this package
    NcclCommunicator = None
else:
    BACKENDS["nccl"] = NcclCommunicator
