"""synkhronos: data parallelism for PyTensor on one machine, and across machines under mpirun."""

from .data import Data, data
from ._protocol.distribute import distribute
from .errors import (NodeFailedError, RemoteTraceback, StepMismatchError, SynkError, SynkTimeoutError,
                     WorkerDiedError, WorkerError)
from ._function.build import function
from ._function.master import Function
from .gpu import get_n_gpu
from .world import World, join, shard, world
from ._runtime import close, fork, master_free
from ._shareds.api import (all_gather, all_reduce, broadcast, gather, get_lengths, get_shapes, get_value,
                           reduce, scatter, set_value)

__version__ = "0.1.0"

__all__ = [
    "fork", "close", "master_free", "function", "distribute", "data", "Data", "Function",
    "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
    "set_value", "get_value", "get_lengths", "get_shapes", "get_n_gpu", "world", "World", "shard", "join",
    "SynkError", "WorkerError", "WorkerDiedError", "RemoteTraceback", "SynkTimeoutError",
    "NodeFailedError", "StepMismatchError",
]


def __dir__():
    # the public API only: the internal modules (_runtime, _procs, ...) stay
    # importable, but dir() and tab completion do not offer them
    return sorted(__all__ + ["__version__"])
