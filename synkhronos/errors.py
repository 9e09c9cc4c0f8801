"""Exceptions that carry a worker's failure home to the master."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from types import FrameType

__all__ = ["SynkError", "RemoteTraceback", "WorkerError", "WorkerDiedError", "SynkTimeoutError",
           "WorkerFailedError", "NodeFailedError", "StepMismatchError"]


class SynkError(RuntimeError):
    """Base of the errors synkhronos raises itself."""


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in another process.

    Chained as the ``__cause__`` of the re-raised exception, so Python prints
    it above the master's own traceback.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class WorkerError(SynkError):
    """A worker raised an exception whose type could not be kept.

    Attributes:
        rank: the rank of the process that raised.
        remote_traceback: the worker's traceback, as text.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        super().__init__(f"worker rank {rank} raised: {message}")
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (_rebuild_worker_error, (self.rank, self.args[0], self.remote_traceback))


def _rebuild_worker_error(rank, text, tb):
    err = WorkerError.__new__(WorkerError)
    SynkError.__init__(err, text)
    err.rank, err.remote_traceback = rank, tb
    return err


class WorkerDiedError(SynkError):
    """A worker process ended while the master needed it.

    Attributes:
        rank: the rank of the dead process.
        exitcode: its exit status, or ``-signal`` when a signal ended it.
    """

    def __init__(self, rank: int, exitcode: int | None):
        self.rank = rank
        self.exitcode = exitcode
        super().__init__(f"worker rank {rank} died ({describe_exit(exitcode)}); "
                         "call synk.close() and then synk.fork() to start again")

    def __reduce__(self):
        return (WorkerDiedError, (self.rank, self.exitcode))


class WorkerFailedError(SynkError):
    """Another worker of the parameter server raised an exception or died; this
    worker cannot go on.

    Attributes:
        rank: the rank of the worker that failed first.
        remote_traceback: its traceback as text ("" when it died without one).
        exitcode: its exit status when known (``-signal`` when a signal ended it).
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = "", exitcode=None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode

    def __reduce__(self):
        return (WorkerFailedError, (self.rank, self.args[0], self.remote_traceback, self.exitcode))


class NodeFailedError(SynkError):
    """Another node failed in the middle of a collective; this one cannot finish.

    Attributes:
        node: the rank (node index) in the MPI communicator of the node that failed.
        reason: what went wrong there, as that node said it.
    """

    def __init__(self, node: int, reason: str, what: str = "a collective"):
        super().__init__(f"node {node} failed during {what}: {reason}; the MPI communicator "
                         "cannot be used again: call synk.close() and synk.fork() again")
        self.node = node
        self.reason = reason


class StepMismatchError(SynkError):
    """The nodes met in different steps: their scripts called different things, or
    one node made a step the others did not. Raised on every node, in the step
    each was making; nothing was combined, and the runtime stays usable.

    Attributes:
        steps: per node, the step it was making, as words ("call f (step 12)").
    """

    def __init__(self, what: str, steps):
        self.steps = list(steps)
        super().__init__(f"{what}: the nodes are in different steps: "
                         + "; ".join(f"node {r}: {t}" for r, t in enumerate(self.steps))
                         + "; every node's script must make the same calls and collectives, "
                           "with the same functions, variables and ops, in the same order")

    def __reduce__(self):
        return (_rebuild, (StepMismatchError, self.args, {"steps": self.steps}))


def _rebuild(cls, args, attrs):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(attrs)
    return err


class SynkTimeoutError(SynkError, TimeoutError):
    """Some workers did not finish a command within the fork's ``timeout``.

    The command was abandoned in every process. The message says whether the
    runtime is still usable (every worker came back) or whether the ranks
    named are still busy (then the next command first waits for them, and
    :func:`synkhronos.close` ends them).

    Attributes:
        ranks: the ranks that had not answered when the time ran out.
        timeout: the timeout, in seconds.
        usable: True when every worker came back after the command was abandoned.
    """

    def __init__(self, message: str, ranks=(), timeout: float | None = None, usable: bool = False):
        super().__init__(message)
        self.ranks = list(ranks)
        self.timeout = timeout
        self.usable = usable

    def __reduce__(self):
        return (SynkTimeoutError, (self.args[0], self.ranks, self.timeout, self.usable))


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def pack_exception(exc: BaseException, rank: int) -> bytes:
    """Pickle an exception raised in process ``rank``, with its traceback text.

    The original exception is kept when it pickles and unpickles; otherwise a
    :class:`WorkerError` with its type and message stands in. So does one that
    is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt`` raised by
    user code in a worker): re-raised as such in the master it would end the
    script or pass for the user's own Ctrl-C.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tb = f'\n"""\nTraceback from worker rank {rank}:\n{tb}"""'
    body = None
    if isinstance(exc, Exception):
        try:
            body = pickle.dumps(exc)
            pickle.loads(body)
        except Exception:
            body = None
    if body is None:
        body = pickle.dumps(WorkerError(rank, f"{type(exc).__name__}: {exc}", tb))
    return pickle.dumps((rank, body, tb))


def unpack_exception(blob: bytes) -> BaseException:
    """Rebuild the exception made by :func:`pack_exception`, ready to raise."""
    rank, body, tb = pickle.loads(blob)
    exc = pickle.loads(body)
    try:
        exc.synk_rank = rank
    except Exception:
        pass
    if not isinstance(exc, WorkerError):
        try:
            exc.add_note(f"(raised in synkhronos worker rank {rank})")
        except Exception:
            pass
    exc.__cause__ = RemoteTraceback(tb)
    return exc


class Aborted(Exception):
    """Raised in a process waiting on others once the master gave up."""


class MasterGone(BaseException):
    """Raised in a worker whose master has died; ends the worker."""


class Interrupted(BaseException):
    """Raised in a worker's computation when the master abandons the command
    (Ctrl-C, a timeout, close() from another thread): a BaseException, so no
    ``except Exception`` in user code or PyTensor keeps it."""


def as_interrupt(err: BaseException) -> BaseException:
    """What an exception stands for when an interrupt caused it: native code (a
    Numba-compiled function, a C thunk) turns a Ctrl-C, or the master's
    interrupt in a worker, into SystemError ("returned a result with an
    exception set"). Returns that KeyboardInterrupt or Interrupted, else ``err``."""
    cause: BaseException | None = err
    seen = 0
    while isinstance(cause, BaseException) and seen < 8:
        if isinstance(cause, (KeyboardInterrupt, Interrupted)):
            return cause if cause is err else cause.with_traceback(err.__traceback__)
        if not isinstance(cause, SystemError):
            return err
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return err


class PeerFailed(Exception):
    """Another process flagged a failure in this collective; nothing was combined."""


def own_share_failed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised by this process's own share of a call once that
    process took its whole part in the call's protocol: the other processes can
    finish the call as they would after any process's error, so the master
    waits for them instead of stopping them, and every process applies its
    updates exactly when its own share ran without error. Returns ``exc``."""
    setattr(exc, "_synk_own_share_failed", True)  # (read back with getattr: any exception takes it)
    return exc


def is_own_share_failure(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`own_share_failed`."""
    return getattr(exc, "_synk_own_share_failed", False) is True


def short_repr(value, limit: int = 80, ellipsis: str = "(...)") -> str:
    """A short text of a value for an error message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - len(ellipsis)] + ellipsis


def user_stacklevel() -> int:
    """For warnings.warn: the level of the first caller outside synkhronos."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level
