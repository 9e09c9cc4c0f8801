"""synkhronos: data parallelism for PyTensor on one machine."""

from .data import Data, data
from .distribute import distribute
from .errors import RemoteTraceback, SynkError, WorkerDiedError, WorkerError
from .function import Function, function
from .runtime import close, fork
from .shareds import (all_gather, all_reduce, broadcast, gather, get_lengths, get_shapes,
                      get_value, reduce, scatter, set_value)

__version__ = "0.1.0"

__all__ = [
    "fork", "close", "function", "distribute", "data", "Data", "Function",
    "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
    "set_value", "get_value", "get_lengths", "get_shapes",
    "SynkError", "WorkerError", "WorkerDiedError", "RemoteTraceback",
]
