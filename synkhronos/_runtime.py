"""fork() and close(): the processes of one fork, and each process's state."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import signal
import threading
import warnings
from typing import TYPE_CHECKING, cast

import numpy as np

from . import _state as state, devices
from ._procs import signals
from ._procs.children import Children, die_of, set_parent_death_signal
from ._protocol import across_nodes as nodes
from ._shareds import homes
from ._state import Process, running_session  # runtime.running_session(): the running fork's Session
from ._protocol.control import Command, ControlBlock
from .errors import user_stacklevel
from ._protocol.session import Session
from ._procs.lease import Lease
from ._procs.shmem import disown, unlink_prefix
from .devices.jax_state import jax_backends_up
from ._procs.cores import available_cores, core_groups, keep_freed_memory, limit_threads, pin
from ._protocol.worker_loop import serve, serve_profiled

if TYPE_CHECKING:
    from .collectives.base import Communicator

__all__ = ["fork", "close", "master_free"]

log = logging.getLogger("synkhronos")

_DEVICES = ("auto", "cpu", "gpu")
#: Seconds the master waits for workers to leave at close() before SIGTERM, then SIGKILL.
CLOSE_GRACE = 2.0


def fork(n_parallel: int | None = None, device: str = "auto", master_rank: int = 0,
         pin_cores: bool | None = None, *, use_gpu: bool | None = None,
         profile_workers=False, max_n_var: int | None = None, max_dim: int | None = None,
         timeout: float | None = None, idle_spin: float | None = None) -> int:
    """Start the worker processes; the master carries on in the calling script.

    Must be the first synkhronos call. Works at the top of a plain script (no
    ``if __name__ == "__main__"`` guard): workers are forked and never return
    into the script.

    Args:
        n_parallel: number of processes, master included. Default: one per
            GPU on a GPU device, else one per core this process may use. More
            than the cores is allowed on CPU, with a warning.
        device: ``"auto"`` (GPU when one and the GPU stack are present, else
            CPU), ``"cpu"`` or ``"gpu"``.
        master_rank: the rank of the calling process.
        pin_cores: bind each process (master included, until close()) to its
            own share of the cores. Default: when there are at least as many
            cores as processes. Pinned processes do not migrate between cores
            and find each other awake, which halves the cost of a small call.
        use_gpu: the original Synkhronos's switch. ``False`` is
            ``device="cpu"``; ``True`` is ``device="auto"``, with a warning
            naming the reason when no GPU can be used and the CPU is used
            instead (``device="gpu"`` makes that an error). A bool given in
            ``device``'s place (the original's second argument) means ``use_gpu``.
        profile_workers: record each worker's work with :mod:`cProfile`:
            ``True`` writes ``synk_worker_<rank>.prof`` (one file per worker
            rank, as the original did) into the current directory when the
            worker ends at :func:`close`; a directory path writes them there.
            Read them with :mod:`pstats` (``python -m pstats FILE``).
        max_n_var, max_dim: limits of the original's fixed-size buffers;
            synkhronos has no such limits, so they are checked and ignored.
        timeout: the longest, in seconds, that a call or collective waits
            for the workers. Default ``None``: wait as long as they compute
            (a warning naming the ranks is logged every
            ``synkhronos._protocol.session.WAIT_WARNING_INTERVAL`` seconds, 60). When the time
            runs out the command is abandoned in every process and
            :class:`~synkhronos.SynkTimeoutError` names the ranks that had
            not answered and says whether the runtime is still usable.
            Under a launcher it also bounds the wait for MPI to start, which
            ends once every node has called ``fork()``: a node still loading
            its data, or one that failed before its ``fork()``, makes this
            ``fork()`` raise :class:`~synkhronos.SynkTimeoutError` (its fork
            closed; calling ``fork()`` again waits again).
        idle_spin: seconds an idle worker keeps polling for the next command
            before it sleeps (default ``0.02``). While it polls, a call costs
            no kernel wake-up (a loop of calls with pauses shorter than this
            runs as fast as a tight loop), and each polling worker uses one
            core; after it, an idle fork uses no CPU and the next call pays a
            wake-up (tens of microseconds). ``0`` never polls.

    Returns:
        The number of processes, master included.

    Under a launcher (``mpirun``, ``srun``; see :doc:`nodes`) each launched
    copy of the script is the master of its node: it forks its node's
    workers, then starts MPI and joins the other nodes' masters, and calls
    and collectives span every process of every node
    (:func:`synkhronos.world` says where this node stands).

    On a GPU device each process uses GPU ``rank % n_gpus`` (bound through
    ``CUDA_VISIBLE_DEVICES`` before CUDA starts) and runs its functions
    through PyTensor's JAX backend; when every process has a GPU of its own,
    output reductions and shared-variable collectives go through NCCL.

    Raises:
        RuntimeError: already forked; ``device="gpu"`` without the GPU stack
            (the message names what to install) or without a visible GPU; JAX
            already initialised CUDA in this process.
        TypeError, ValueError: a bad argument, named in the message.
    """
    if state.current() is not None:
        raise RuntimeError("synk.fork() was already called; call synk.close() before forking again")
    timeout = _check_timeout(timeout)
    idle_spin = _check_idle_spin(idle_spin)
    if pin_cores is not None and not isinstance(pin_cores, bool):
        raise TypeError(f"pin_cores must be True, False or None, got {pin_cores!r}")
    device = _device_for(device, use_gpu)
    for key, limit in (("max_n_var", max_n_var), ("max_dim", max_dim)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise TypeError(f"{key} must be a positive int or None (it is ignored), got {limit!r}")
    profile_dir = _profile_dir(profile_workers)
    device_cls, units = devices.choose(device, use_gpu)
    if nodes.launched():  # several copies on one host: each its own cores
        nodes.warn_if_mpi_started()
        nodes.share_host_cores()
    cores = available_cores()
    n_parallel = _check_parallel(n_parallel, units or cores, cores, master_rank)
    dev = devices.create(device_cls, units, n_parallel, master_rank)  # binds the master to its unit
    proc = _open_master(dev, n_parallel, master_rank, profile_dir)
    proc.launched = nodes.launched()  # under mpirun/srun: join the other nodes after forking
    threads = max(1, cores // n_parallel)
    groups = core_groups(n_parallel) if pin_cores is not False else None
    if pin_cores and groups is None:
        warnings.warn(f"pin_cores=True, but {n_parallel} processes do not fit on {cores} cores "
                      "one each: not pinning", stacklevel=user_stacklevel())
    keep_freed_memory()  # before forking: the workers inherit it
    state.spin.idle = idle_spin  # the workers inherit the policy too
    state.spin.oversubscribed = n_parallel > cores
    pids = _spawn_workers(proc, groups, threads)
    thread_limit = limit_threads(threads)
    s = Session(proc, pids, thread_limit, close, threads)
    state.set_current(s)
    s.timeout = timeout
    state.inherited_from = None
    s.saved_handlers = signals.install_master_handlers()
    if groups is not None:
        s.saved_affinity = pin(groups[master_rank])
    cast("Communicator", proc.comm).check = s.check  # (_open_master opened it)
    log.debug("forked %d workers: %s", len(pids), pids)
    s.begin_wait()  # fork(timeout=...) counts from here for the waits of the start (never from 0.0)
    try:
        if proc.launched:  # MPI starts now, after the fork; the workers wait for the node table
            nodes.connect(proc, s.check)
            s.on_step = functools.partial(nodes.begin_step, proc)
            s.on_break = functools.partial(nodes.broke, proc)
        atexit.register(_close_at_exit)  # after join: it runs before MPI is finalised at exit
        dev.start(s)  # GPU: every process opens its GPU; NCCL when each has its own
    except BaseException:
        close()
        raise
    return n_parallel


def _check_parallel(n_parallel, default: int, cores: int, master_rank) -> int:
    """fork()'s ``n_parallel`` (``default`` for None) and ``master_rank``, checked."""
    if n_parallel is None:
        n_parallel = default
    if isinstance(n_parallel, bool) or not isinstance(n_parallel, int):
        raise TypeError(f"n_parallel must be a positive int or None, got {n_parallel!r}")
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be at least 1, got {n_parallel}")
    if n_parallel > cores:
        warnings.warn(f"n_parallel={n_parallel} is more than the {cores} cores available; "
                      "processes will share cores", stacklevel=user_stacklevel())
    if isinstance(master_rank, bool) or not isinstance(master_rank, int):
        raise TypeError(f"master_rank must be an int, got {master_rank!r}")
    if not 0 <= master_rank < n_parallel:
        raise ValueError(f"master_rank must be in [0, {n_parallel}), got {master_rank}")
    return n_parallel


def _open_master(device, n_parallel: int, master_rank: int, profile_dir) -> Process:
    """The master's Process: its lock file, control block and host communicator
    (all undone if one of them fails)."""
    lease = Lease.new()  # the fork's lock file: created first, unlinked last (stale names go first)
    prefix = lease.prefix
    proc = Process(prefix, master_rank, n_parallel, master_rank, device)
    proc.lease = lease
    proc.profile_dir = profile_dir
    try:
        proc.control = ControlBlock(prefix, n_parallel, master_rank, create=True)
        proc.comm = device.open_host_comm(proc, create=True)
    except BaseException:
        proc.close()
        unlink_prefix(prefix)
        device.unbind()
        raise
    return proc


def _spawn_workers(proc: Process, groups, threads: int) -> dict:
    """Fork the workers; returns rank -> pid. Each child pins itself to its cores
    and becomes a worker, never returning here."""
    # the workers' rule: they die of a signal only where the master would
    state.signal_state.dispositions = {sig: signal.getsignal(sig) for sig in signals.FATAL_SIGNALS}
    def in_child(rank: int) -> None:  # pragma: no cover - the child, which never returns
        if groups is not None:
            pin(groups[rank])
        _become_worker(proc, rank, threads)

    children = Children()
    children.spawn([r for r in range(proc.size) if r != proc.master_rank], in_child)
    for rank, pid in children.pids.items():
        if groups is not None:  # here too: fork() returns with every worker pinned, not only soon after
            try:
                os.sched_setaffinity(pid, groups[rank])
            except (AttributeError, OSError):  # gone already (the master notices), or unsupported
                pass
    return children.pids


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds or None, got {timeout!r}")
    return float(timeout)


def _check_idle_spin(idle_spin) -> float:
    if idle_spin is None:
        return state.IDLE_SPIN_DEFAULT
    if isinstance(idle_spin, bool) or not isinstance(idle_spin, (int, float, np.integer, np.floating)):
        raise TypeError(f"idle_spin must be a number of seconds or None, got {idle_spin!r}")
    if not math.isfinite(idle_spin) or idle_spin < 0:
        raise ValueError(f"idle_spin must be a finite number of seconds >= 0, got {idle_spin!r}")
    return float(idle_spin)


def _device_for(device, use_gpu) -> str:
    """The device asked for by ``device`` and the original's ``use_gpu``."""
    if isinstance(device, bool):  # the original's fork(n_parallel, use_gpu, ...)
        if use_gpu is not None:
            raise TypeError(f"use_gpu given twice: as the second argument ({device!r}) and by keyword")
        device, use_gpu = "auto", device
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    if use_gpu is None:
        return device
    if not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True, False or None, got {use_gpu!r}")
    if device == ("cpu" if use_gpu else "gpu"):
        raise ValueError(f"use_gpu={use_gpu} contradicts device={device!r}; give one of them")
    return device if use_gpu else "cpu"


def _profile_dir(profile_workers) -> str | None:
    """Where workers write their cProfile stats, or None to not profile them."""
    if profile_workers is None or profile_workers is False:
        return None
    if profile_workers is True:
        return os.getcwd()
    if isinstance(profile_workers, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(profile_workers))
        if not os.path.isdir(path):
            raise ValueError(f"profile_workers={profile_workers!r} is not an existing directory")
        return path
    raise TypeError(f"profile_workers must be True, False or a directory path, got {profile_workers!r}")


def _become_worker(master_proc: Process, rank: int, threads: int) -> None:  # pragma: no cover
    """The forked child's whole life; never returns into the user's script."""
    code = 0
    try:
        signals.worker_signals()
        set_parent_death_signal()
        atexit._clear()
        if master_proc.lease is not None:  # the master's descriptor: this worker takes its own
            master_proc.lease.close()
        state.jax_inherited = jax_backends_up()  # before bind() may configure JAX
        master_proc.device.bind(rank)  # before anything touches the accelerator
        # the master compiles every function too, and gives this warning once
        warnings.filterwarnings("ignore", "PyTensor could not link to a BLAS installation", UserWarning)
        proc = Process(master_proc.prefix, rank, master_proc.size, master_proc.master_rank,
                       master_proc.device)
        proc.master_pid = os.getppid()
        if proc.master_pid != master_proc.master_pid:
            os._exit(1)
        proc.lease = Lease(proc.prefix)
        proc.control = ControlBlock(proc.prefix, proc.size, proc.master_rank, create=False)
        proc.comm = proc.device.open_host_comm(proc, create=False)
        if master_proc.launched:  # the communicator over every node, once the master joined them
            nodes.connect_worker(proc)
        state.interruptible.control = proc.control
        limit_threads(threads, worker=True)
        if master_proc.profile_dir is None:
            code = serve(proc)
        else:
            code = serve_profiled(proc, master_proc.profile_dir)
    except BaseException:
        code = 1
    finally:
        terminate_signal = state.signal_state.terminate_signal
        if terminate_signal is not None:  # die of the signal, so the master can name it
            try:
                die_of(terminate_signal)
            except BaseException:
                pass
        os._exit(code)


def _after_fork_in_child() -> None:
    """In a child the user forked from the master (os.fork, multiprocessing):
    the runtime belongs to the master. Nothing here may drive its workers,
    unlink its shared memory or hold its lock; public calls raise."""
    s = state.current()
    if s is None:
        return  # also synkhronos's own workers: they are forked before the session exists
    state.set_current(None)
    state.inherited_from = s.pid
    disown(s.proc.prefix)
    if s.proc.lease is not None:
        s.proc.lease.close()  # this process's copy of the master's descriptor only


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def master_free():
    """A block of the master's own work between calls, on the cores and threads it
    had before :func:`fork`.

    ``fork()`` binds the master to its share of the cores and caps its native
    thread pools (BLAS, OpenMP, Numba's running pool) at that share, so that its
    part of each call does not crowd the workers. Between calls the workers are
    idle (they sleep after ``idle_spin``), and the master's own work, such as a
    sampler's summaries, a plot or preprocessing, can use every core::

        f(x)                           # the master computes its share on its core
        with synk.master_free():
            summary = heavy_numpy(...)  # every core, BLAS at its usual threads
        f(x)                           # capped and bound again

    Calls made inside the block work and give the same results, but the master's
    share then runs with every thread, beside the workers (slower, not wrong).

    Raises:
        RuntimeError: before :func:`fork`, inside a running command, or nested.
    """
    s = running_session()
    state.refuse_nested("master_free")
    if s.freed:
        raise RuntimeError("synk.master_free() is already in effect (blocks do not nest)")
    s.thread_limit.restore()
    bound = pin(s.saved_affinity) if s.saved_affinity is not None else None
    s.freed = True
    try:
        yield
    finally:
        s.freed = False
        if state.current() is s:  # (closed inside the block: close() restored everything)
            if bound is not None:
                pin(bound)
            s.thread_limit = limit_threads(s.threads)


def close() -> None:
    """End every worker and unlink every segment and semaphore of this fork.

    Safe to call twice, after a failure, and before fork() (then it does
    nothing). ``fork()`` works again afterwards. Also runs at interpreter exit.
    Workers get a grace period to leave, then SIGTERM, then SIGKILL.

    Called from another thread while a call or collective runs, it makes that
    call give up and raise :class:`~synkhronos.SynkError`, then closes; called
    from a signal handler during a call, the fork closes as the call ends. In
    a process the user forked from the master, it only forgets the master's
    fork there, which it never touches. A Ctrl-C during close() does not stop
    it: the workers are killed at once, everything is unlinked, then the
    ``KeyboardInterrupt`` is raised.

    Args:
        None.

    Returns:
        None.

    Raises:
        KeyboardInterrupt: a Ctrl-C came during close(), after it finished.
        Nothing else: what cannot be closed cleanly is killed and logged.
    """
    s = state.current()
    if s is None:
        return
    if os.getpid() != s.pid:  # a child of the master forked without Python's fork hooks
        _after_fork_in_child()
        return
    if s.in_flight == threading.get_ident():
        # a signal handler (or an Op) inside a running command of this thread:
        # stop the command; Session.run closes the fork as it unwinds
        _request_close(s)
        return
    if not state.command_lock.acquire(blocking=False):
        _request_close(s)  # the call running in another thread stops at its next wait slice
        state.command_lock.acquire()
    try:
        if state.current() is s:
            _teardown(s)
    finally:
        state.command_lock.release()


def _request_close(s: Session) -> None:
    s.close_requested = True
    try:
        s.abort()
        s.interrupt_workers()
    except Exception:  # the control block may be half gone; the waits see the request anyway
        pass


def _teardown(s: Session) -> None:
    """close()'s work. Every step runs even after an earlier one failed or a
    Ctrl-C came; a Ctrl-C is raised at the end."""
    s.closed = True
    proc = s.proc
    interrupts: list = []

    def step(fn, *args):
        try:
            fn(*args)
        except Exception:
            log.debug("synkhronos: a step of close() failed", exc_info=True)
        except BaseException as err:  # Ctrl-C, SystemExit from a handler: finish first
            interrupts.append(err)

    def release_memory():
        # every Data (function and collective scratch included) registered its memory here
        for mem in list(s.data_memory.values()):  # Data objects still alive: their arrays stay valid
            mem.release()
        s.data_memory.clear()

    def leave_homes():
        try:
            homes.leave_homes(proc)
        except Exception:  # the values stay where they are, valid; only their memory lingers
            log.exception("synkhronos: could not copy shared variables out of shared memory")

    if proc.control is not None and proc.control.pending():  # busy with an abandoned command
        step(s.abort)
        step(s.interrupt_workers)
    # also after a failure: live workers finish what they do, then leave
    step(proc.control.post, Command.CLOSE, None)
    step(s.watch.end, CLOSE_GRACE, interrupts)
    step(release_memory)
    step(proc.kept.clear)  # kept records hold views of the workers' homes: unmapped with the rest
    step(leave_homes)
    step(nodes.note_failure, proc)
    step(proc.close)
    step(unlink_prefix, proc.prefix)
    step(s.thread_limit.restore)
    if s.saved_affinity is not None:
        step(pin, s.saved_affinity)
    step(proc.device.unbind)
    step(signals.restore_master_handlers, s.saved_handlers)
    step(atexit.unregister, _close_at_exit)
    if state.current() is s:
        state.set_current(None)
    if interrupts:
        raise interrupts[0]


def _close_at_exit() -> None:
    s = state.current()
    if s is None or os.getpid() != s.pid:  # a child forked from the master: not its fork
        return
    nodes.abandon_at_exit(s.proc)  # an uncaught error here: the other nodes raise at once
    try:
        close()
    except BaseException:  # at exit there is nobody left to tell
        log.exception("synkhronos: close() at exit failed")
