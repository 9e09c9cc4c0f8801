"""Communicators: one interface, one class per backend."""

from ..errors import PeerFailed
from .base import Communicator
from .ops import REDUCE_OPS, check_op
from .mpi import MpiCommunicator
from .nccl import NcclCommunicator
from .shm import ShmCommunicator

__all__ = ["Communicator", "ShmCommunicator", "PeerFailed", "REDUCE_OPS", "check_op", "BACKENDS"]

#: backend name -> Communicator class (nccl.py imports CuPy, mpi.py mpi4py, only when a
#: communicator is made).
BACKENDS = {"shm": ShmCommunicator, "nccl": NcclCommunicator, "mpi": MpiCommunicator}
