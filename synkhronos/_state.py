"""This process's state: the one module with module-level mutable state.

What a process of a fork holds (:class:`Process`), the master's running
session, the lock that lets one command run at a time, the flags the signal
handlers set, the worker's interruptible region, id counters, the prefixes of
forks this process only inherited, and the GPU it is bound to. Every other
module reads and writes these through this module, never through globals of
its own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from typing import TYPE_CHECKING, Any, cast

from .errors import Aborted, Interrupted, MasterGone
from ._kept.records import Kept

if TYPE_CHECKING:
    from ._procs.lease import Lease
    from ._protocol.control import ControlBlock
    from ._protocol.session import Session
    from .collectives.base import Communicator

__all__ = []


class Process:
    """What one process (master or worker) of a fork holds."""

    def __init__(self, prefix: str, rank: int, size: int, master_rank: int, device):
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self.master_rank = master_rank
        self.device = device  # devices.Device: every decision that depends on the device
        self.is_master = rank == master_rank
        self.master_pid = os.getpid() if self.is_master else os.getppid()
        self.control: ControlBlock | None = None
        self.comm: Communicator | None = None
        self.functions: dict[int, Any] = {}   # function id -> local executor
        self.function_digests: dict[Any, Any] = {}  # across nodes: digest of a function -> functions built with it, less one
        self.shareds: dict[int, Any] = {}     # shared-variable id -> this process's variable
        self.data_cache: dict[int, Any] = {}  # data id -> (attached Segment, {(dtype, shape): view})
        self.profile_dir: str | None = None  # workers write cProfile stats here (fork(profile_workers=...))
        self.lease: Lease | None = None     # this process's lock on the fork's lock file
        self.kept = Kept()    # every record that lets a call or collective skip checks (_kept/records.py)
        self.launched = False  # started by mpirun/srun: joins the other nodes (_protocol/across_nodes.py)

    def check_parent(self) -> None:
        """Worker-side: raise MasterGone once the master process has died."""
        if signal_state.terminate_requested or self.master_died():
            raise MasterGone()

    def master_died(self) -> bool:
        """Worker-side: the master has died (a parent-death signal came, or we were reparented)."""
        return signal_state.master_died or os.getppid() != self.master_pid

    def check_master(self) -> None:
        """Worker-side check between wait slices inside a collective."""
        self.check_parent()
        if cast("ControlBlock", self.control).aborted():  # (a worker has its control block from its start)
            raise Aborted("the master abandoned this command")

    def close(self) -> None:
        self.kept.clear()
        for seg, _ in self.data_cache.values():
            seg.close()
        self.data_cache.clear()
        self.device.close()  # its communicator (NCCL), before the host one it talks through
        if self.comm is not None:
            self.comm.close()
        if self.control is not None:
            self.control.close()
        if self.lease is not None:
            self.lease.close()


class SignalState:
    """What the signal handlers of this process have seen (read by the liveness checks)."""

    __slots__ = ("terminate_requested", "terminate_signal", "master_died", "dispositions")

    def __init__(self):
        self.terminate_requested = False  # a worker: a terminating signal came
        self.terminate_signal = None      # ... which one (the worker dies of it at the end)
        self.master_died = False          # a worker: the parent-death signal came
        #: The master's dispositions of signals.FATAL_SIGNALS when it forked (read by the workers).
        self.dispositions = {}


signal_state = SignalState()


class _Interruptible:
    """``with interruptible:`` marks where a worker may be stopped by the master's
    interrupt signal: its computation, not the bookkeeping of the protocol
    (that notices the abort flag at its next wait). A no-op in the master,
    whose Ctrl-C is Python's own."""

    __slots__ = ("control", "armed")

    def __init__(self):
        self.control = None   # the worker's ControlBlock; None in the master
        self.armed = False

    def __enter__(self):
        if self.control is not None:
            if self.control.aborted():  # the interrupt came before the computation began
                raise Interrupted("the master abandoned this command")
            self.armed = True
        return self

    def __exit__(self, *exc):
        self.armed = False
        return False


interruptible = _Interruptible()


#: How long an idle worker polls for the next command before it sleeps, by
#: default (``fork(idle_spin=...)``): a loop of calls, also one with pauses of a
#: few milliseconds between them, never pays a kernel wake-up; a fork idle for
#: longer costs no CPU.
IDLE_SPIN_DEFAULT = 20e-3


class SpinPolicy:
    """How this process's waits poll before they sleep (set by fork(), inherited by the workers)."""

    __slots__ = ("idle", "oversubscribed")

    def __init__(self):
        self.idle = IDLE_SPIN_DEFAULT  # seconds an idle worker polls for the next command
        self.oversubscribed = False   # more processes than cores: yield the core while polling


spin = SpinPolicy()


#: The master's running session, None when no fork runs here.
_current: Session | None = None
#: The master's pid when this process was forked from it by the user after
#: synk.fork() (its fork is not ours to use), else None.
inherited_from: int | None = None
#: One command at a time: a call or collective from a second thread waits for
#: the first (re-entrant: a call may distribute first).
command_lock = threading.RLock()


def current() -> Session | None:
    """The running session, or None."""
    return _current


def set_current(s) -> None:
    """Make ``s`` (a session.Session, or None) the running session."""
    global _current
    _current = s


#: This process's multiverso parameter server (multiverso.api's state), once
#: multiverso.init() ran here; and whether it ever ran (init() is once a process).
_multiverso = None
_multiverso_started = False


def multiverso_server():
    """The multiverso server state of this process, or None before ``init()``."""
    return _multiverso


def multiverso_started() -> bool:
    return _multiverso_started


def set_multiverso_server(state) -> None:
    """Record the multiverso server state started by ``multiverso.init()``."""
    global _multiverso, _multiverso_started
    _multiverso, _multiverso_started = state, True


def serialized(fn):
    """Let one thread at a time into ``fn`` (public calls that talk to the workers)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with command_lock:
            refuse_nested(fn.__name__)
            return fn(*args, **kwargs)

    return wrapper


def refuse_nested(what) -> None:
    """RuntimeError if this thread is inside a running command already (a signal
    handler or a custom Op's ``perform`` calling synkhronos during a call): the
    re-entrant lock lets it through, and its messages would mix into the
    running command's. ``what`` names the call: a name, or a command (its
    name is looked up only for the message)."""
    s = _current
    if s is not None and s.in_flight == threading.get_ident():
        what = what if isinstance(what, str) else what.name.lower()
        raise RuntimeError(f"synkhronos {what}() was called while another synkhronos command "
                           "is running in this thread (from a signal handler, or from code "
                           "that a synkhronos function runs); nested commands are not "
                           "supported: make the call after the running one returns")


def running_session() -> Session:
    """The running fork; RuntimeError before fork() and in a process the user
    forked from the master."""
    if _current is None:
        if inherited_from is not None:
            raise RuntimeError(
                f"this process (pid {os.getpid()}) was forked from the synkhronos master (pid "
                f"{inherited_from}) after synk.fork(): the workers belong to that process and "
                "only it can use them; call synk.fork() here to start a fork of this process's own")
        raise RuntimeError("synkhronos is not running: call synk.fork() first")
    return _current


_function_ids = itertools.count(1)
_data_ids = itertools.count(1)


def next_function_id() -> int:
    """A new id for a synk.function, unique in this process."""
    return next(_function_ids)


def next_data_id() -> int:
    """A new id for a synk.data, unique in this process."""
    return next(_data_ids)


#: Prefixes of forks that this process only inherited (the user forked it from
#: a master after synk.fork()): nothing of theirs is unlinked from here.
foreign_prefixes: set[str] = set()

#: Keys of the warnings given once per process, already given here.
warned: set[str] = set()

#: A node communicator was abandoned in a failure here: MPI is aborted at exit,
#: not finalised (_protocol/across_nodes.py).
nodes_broken = False

#: MPI's finalisation is registered to run at exit (_protocol/across_nodes.py, once MPI started here).
mpi_finalize_registered = False

#: The start of MPI (launch.mpi): MPI_Init's thread while it runs, whether MPI was
#: initialised here, and what MPI_Init raised.
mpi_start: dict[str, Any] = {"thread": None, "ours": None, "error": None}

#: Headers of nodes that left, waiting for the others' next exchange when their
#: communicator was freed: MPI completes them later (MPI_Finalize waits for them),
#: so their buffers must live as long as the process (collectives/mpi.py).
mpi_leaving: list = []
#: The duplicates of MPI_COMM_WORLD (and their requests) that a fork() gave up making (its
#: timeout passed): the other nodes' next try meets these, so the next one here waits for
#: them instead of starting others (_protocol/across_nodes.py, collectives/mpi.py).
mpi_pending_dup: tuple | None = None

#: The GPU (a CUDA_VISIBLE_DEVICES value) this process was bound to, or None.
bound_gpu: str | None = None

#: In a worker: JAX was already running in the master when it forked this process,
#: so JAX cannot run here (its threads did not come along: it aborts or hangs).
jax_inherited: bool = False

#: The threads of this process now inside an XLA host callback: a distributed function
#: rendered in JAX (Function.as_op under numpyro or blackjax) runs the master's share there.
#: JAX cannot run inside its own callback (the outer computation holds what the inner one
#: needs: it hangs, now and then; jax-ml/jax#24255), so such a share runs without JAX.
_xla_callback = threading.local()


@contextlib.contextmanager
def inside_xla_callback():
    """Marks this thread as inside an XLA host callback while the block runs."""
    before = getattr(_xla_callback, "inside", False)
    _xla_callback.inside = True
    try:
        yield
    finally:
        _xla_callback.inside = before


def in_xla_callback() -> bool:
    """Whether this thread is inside an XLA host callback (see :func:`inside_xla_callback`)."""
    return getattr(_xla_callback, "inside", False)
