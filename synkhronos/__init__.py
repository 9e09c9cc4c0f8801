"""synkhronos: data parallelism for PyTensor on one machine."""

from .data import Data, data
from .distribute import distribute
from .errors import RemoteTraceback, SynkError, WorkerDiedError, WorkerError
from .function import Function, function
from .runtime import close, fork

__version__ = "0.1.0"

__all__ = [
    "fork", "close", "function", "distribute", "data", "Data", "Function",
    "SynkError", "WorkerError", "WorkerDiedError", "RemoteTraceback",
]
