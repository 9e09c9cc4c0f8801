"""fork() and close(): the processes of one fork, and each process's state."""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np

from . import gpu
from .collectives import PeerFailed, ShmCommunicator
from .control import ChildWatch, Command, ControlBlock, interruptible
from .errors import (Aborted, Interrupted, MasterGone, SynkError, SynkTimeoutError, WorkerDiedError, as_interrupt,
                     unpack_exception)
from .shmem import Lease, disown, unlink_prefix, unlink_stale
from .tuning import available_cores, core_groups, keep_freed_memory, limit_threads, pin

__all__ = ["fork", "close"]

log = logging.getLogger("synkhronos")

_DEVICES = ("auto", "cpu", "gpu")
#: Seconds the master waits for workers to leave at close() before SIGTERM, then SIGKILL.
CLOSE_GRACE = 2.0
#: Seconds between the warnings logged while the master waits for workers that
#: have not answered a command (module constant: a test may shorten it).
WAIT_WARNING_INTERVAL = 60.0
#: Seconds the workers get to come back after a command was abandoned (Ctrl-C,
#: a timeout, close() from another thread) before the master raises all the same.
INTERRUPT_GRACE = 1.0
#: How often the master repeats its interrupt signal to workers still busy.
_RESIGNAL_EVERY = 0.2


class Process:
    """What one process (master or worker) of a fork holds."""

    def __init__(self, prefix: str, rank: int, size: int, master_rank: int, device: str):
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self.master_rank = master_rank
        self.device = device
        self.is_master = rank == master_rank
        self.master_pid = os.getpid() if self.is_master else os.getppid()
        self.control: ControlBlock | None = None
        self.comm = None
        self.functions = {}   # function id -> local executor
        self.shareds = {}     # shared-variable id -> this process's variable
        self.data_cache = {}  # data id -> (attached Segment, {(dtype, shape): view})
        self.gpu_plan = None  # gpu.GpuPlan on a GPU device
        self.gpu = None       # gpu.GpuState once this process opened its GPU
        self.nccl = None      # NcclCommunicator when every process has a GPU of its own
        self.profile_dir = None  # workers write cProfile stats here (fork(profile_workers=...))
        self.lease: Lease | None = None  # this process's lock on the fork's lock file

    def check_parent(self) -> None:
        """Worker-side: raise MasterGone once the master process has died."""
        if _terminate_requested or self.master_died():
            raise MasterGone()

    def master_died(self) -> bool:
        """Worker-side: the master has died (a parent-death signal came, or we were reparented)."""
        return _master_died or os.getppid() != self.master_pid

    def check_master(self) -> None:
        """Worker-side check between wait slices inside a collective."""
        self.check_parent()
        if self.control.aborted():
            raise Aborted("the master abandoned this command")

    def close(self) -> None:
        for seg, _ in self.data_cache.values():
            seg.close()
        self.data_cache.clear()
        if self.nccl is not None:
            self.nccl.close()
            self.nccl = None
        if self.comm is not None:
            self.comm.close()
        if self.control is not None:
            self.control.close()
        if self.lease is not None:
            self.lease.close()


class Session:
    """The master's handle on a running fork."""

    def __init__(self, proc: Process, pids: dict[int, int], thread_limit):
        self.proc = proc
        self.watch = ChildWatch(pids)
        self.thread_limit = thread_limit
        self.broken: BaseException | None = None
        self.functions = []          # Function objects, in creation order
        self.distributed = set()     # ids of functions the workers hold
        self.shared_ids = {}         # id(shared variable) -> sid
        self.shared_vars = {}        # sid -> shared variable (keeps them alive)
        self.dropped = []            # Data uids whose old mappings workers should close
        self.saved_affinity = None   # the master's cores before fork() pinned it
        self.collective_scratch = {}  # staging Data for values the master sends
        self.data_memory = {}        # Data uid -> its shared memory, while the Data lives
        self.in_flight = None        # thread id while a command runs (nested calls are refused)
        self.pid = os.getpid()       # the process that called fork(): the only one that may use it
        self.timeout: float | None = None  # fork(timeout=...): longest wait for the workers
        self.close_requested = False  # close() came during a command (another thread, a handler)
        self.closed = False
        self.saved_handlers = {}     # signal -> the disposition fork() replaced in the master
        self._needs_reset = False    # the abort flag was raised: reset before the next command
        self._wait_start = 0.0
        self._next_warning = 0.0
        self._next_signal = 0.0

    @property
    def n_parallel(self) -> int:
        return self.proc.size

    def poll(self) -> None:
        """Between wait slices: raise WorkerDiedError (and mark the fork broken)
        if a worker has died, stop the command when it ran out of time or
        close() was called meanwhile, and warn when a wait lasts long."""
        try:
            self.watch.poll()
        except WorkerDiedError as err:
            self.broken = err
            self._abort()
            raise
        if self.close_requested:
            raise _CloseRequested()
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + WAIT_WARNING_INTERVAL
            log.warning("synkhronos: waited %.0f s for worker ranks %s to finish the command "
                        "(busy or stuck); fork(timeout=...) bounds the wait, Ctrl-C abandons it",
                        now - self._wait_start, self.proc.control.pending())
        if self.timeout is not None and now - self._wait_start > self.timeout:
            raise _TimedOut(self.proc.control.pending())

    def check(self) -> None:
        """Master-side check between wait slices inside a collective."""
        self.poll()
        if self.proc.control.any_failed():
            # a worker failed outside a collective's own error protocol: free the others
            self._abort()
            raise Aborted("a worker failed during a collective")

    def _abort(self) -> None:
        """Tell the workers to give up the running command (read between their wait slices)."""
        self.proc.control.set_abort(True)
        self._needs_reset = True

    def _begin_wait(self) -> None:
        self._wait_start = time.monotonic()
        self._next_warning = self._wait_start + WAIT_WARNING_INTERVAL

    def _interrupt_workers(self, now: float | None = None) -> None:
        """Send the interrupt signal to the workers that have not answered, so
        that a long computation stops at its next Python step."""
        now = time.monotonic() if now is None else now
        self._next_signal = now + _RESIGNAL_EVERY
        for rank in self.proc.control.pending():
            pid = self.watch.pids.get(rank)
            if pid is not None and rank not in self.watch.exited:
                try:
                    os.kill(pid, _INTERRUPT_SIGNAL)
                except ProcessLookupError:
                    pass

    def _poll_abandoned(self, grace_end: float) -> None:
        """The check while waiting for workers to leave an abandoned command."""
        try:
            self.watch.poll()
        except WorkerDiedError as err:
            self.broken = err
            raise
        now = time.monotonic()
        if now >= self._next_signal:
            self._interrupt_workers(now)
        if now >= grace_end:
            raise _GraceOver()

    def _poll_settling(self) -> None:
        """The check while a new command first waits for workers still busy with an abandoned one."""
        self.poll()
        now = time.monotonic()
        if now >= self._next_signal:
            self._interrupt_workers(now)

    def _reset_after_abort(self) -> None:
        """Every worker answered: zero the communicator's semaphores and lower the abort flag."""
        ctl = self.proc.control
        self.proc.comm.reset()
        ctl.new_epoch()
        ctl.set_abort(False)
        self._needs_reset = False

    def _settle(self) -> None:
        """Before a new command: wait until the workers are done with an abandoned
        one (they were told to stop) and reset. Ctrl-C, the timeout and
        close() stop this wait too; the runtime then stays as it was."""
        ctl = self.proc.control
        if ctl.pending():
            self._abort()
            self._begin_wait()
            self._interrupt_workers()
            try:
                errors = ctl.collect(self._poll_settling)
            except _TimedOut as err:
                raise SynkTimeoutError(
                    f"worker ranks {err.ranks} are still busy with a command abandoned earlier and did "
                    f"not finish within timeout={self.timeout} s; synk.close() ends them",
                    err.ranks, self.timeout, usable=False) from None
            except _CloseRequested:
                raise _closed_meanwhile("command") from None
            except BaseException as err:
                raise as_interrupt(err)
            if errors:
                log.debug("errors of an abandoned command, dropped: %s", sorted(errors))
        self._reset_after_abort()

    def usable(self) -> None:
        if self.closed:
            raise SynkError("this synkhronos fork was closed (synk.close()); call synk.fork() "
                            "to start a new one and build its functions again")
        if self.broken is not None:
            raise SynkError(f"synkhronos is unusable after an earlier failure ({self.broken}); "
                            "call synk.close() and synk.fork() again")

    def run(self, cmd: Command, payload, local=None):
        """Send ``cmd`` to every worker, run ``local(proc, payload)`` here, wait for all.

        Returns what ``local`` returned; raises the most telling error of any
        process (a worker's carries its rank and traceback).
        """
        self.usable()
        _refuse_nested(cmd.name.lower())
        self.in_flight = threading.get_ident()
        try:
            return self._run(cmd, payload, local)
        finally:
            self.in_flight = None
            if self.close_requested and _session is self:
                close()  # asked for by a signal handler (or Op) during this command

    def _run(self, cmd: Command, payload, local):
        ctl = self.proc.control
        if self._needs_reset:  # an earlier command was abandoned or failed part-way
            self._settle()
        if self.close_requested:
            raise _closed_meanwhile(cmd.name.lower())
        dropped, self.dropped = self.dropped, []
        try:
            ctl.post(cmd, (dropped, payload))
        except BaseException:  # nothing was sent (a full /dev/shm): the next command tells them
            self.dropped[:0] = dropped
            raise
        self._begin_wait()
        result = local_err = stop = None
        aborted = False
        try:
            if local is not None:
                result = local(self.proc, payload)
        except WorkerDiedError:
            raise
        except BaseException as err:  # also Ctrl-C: free the workers, then re-raise
            err = as_interrupt(err)
            if _is_stop(err):
                stop = err
            else:
                local_err = err
            if not isinstance(err, PeerFailed):
                self._abort()
                aborted = True
        errors, stop = self._collect(stop)
        if errors is None:  # abandoned, and some workers are still busy with it
            raise self._stopped(cmd, stop, back=False)
        if aborted or errors or stop is not None:
            self._reset_after_abort()
        if stop is not None:
            raise self._stopped(cmd, stop, back=True)
        unpacked = {rank: unpack_exception(blob) for rank, blob in errors.items()}
        if local_err is not None:
            unpacked[self.proc.rank] = local_err
        if unpacked:
            raise _most_telling(unpacked)
        return result

    def _collect(self, stop):
        """Wait for every worker's answer to the posted command.

        With ``stop`` (Ctrl-C, a timeout, close() meanwhile), or once one
        comes during the wait, the command is abandoned: the workers are told
        to give it up (abort flag and interrupt signal) and get
        ``INTERRUPT_GRACE`` seconds to answer. A second Ctrl-C ends that
        grace at once. Returns ``(errors by rank, stop)``, errors None when
        some workers are still busy (the next command waits for them first).
        """
        ctl = self.proc.control
        grace_end = None
        while True:
            try:
                if stop is None:
                    return ctl.collect(self.poll), None
                if grace_end is None:
                    self._abort()
                    self._interrupt_workers()
                    grace_end = time.monotonic() + INTERRUPT_GRACE
                return ctl.collect(lambda: self._poll_abandoned(grace_end)), stop
            except WorkerDiedError:
                raise
            except _GraceOver:
                return None, stop
            except BaseException as err:
                err = as_interrupt(err)
                if not _is_stop(err):
                    self.broken = err
                    self._abort()
                    raise
                if stop is None:
                    stop = err
                elif isinstance(err, KeyboardInterrupt):
                    return None, stop

    def _stopped(self, cmd: Command, stop: BaseException, back: bool) -> BaseException:
        """The exception that ends an abandoned command, saying whether the runtime is usable."""
        what = cmd.name.lower()
        busy = self.proc.control.pending()
        state = ("every process is back and synkhronos is usable" if back else
                 f"worker ranks {busy} are still busy with it: the next command first waits for "
                 "them (they were told to stop), synk.close() ends them")
        if isinstance(stop, _TimedOut):
            return SynkTimeoutError(
                f"worker ranks {stop.ranks} did not finish the {what} command within "
                f"timeout={self.timeout} s; the command was abandoned, and {state}",
                stop.ranks, self.timeout, usable=back)
        if isinstance(stop, _CloseRequested):
            return _closed_meanwhile(what)
        try:
            stop.add_note(f"synkhronos: the {what} command was abandoned in every process; {state}. "
                          "Updates it made may have been applied in some processes only.")
        except Exception:
            pass
        return stop

def _most_telling(errors: dict):
    """The root cause among the processes' errors: not a follow-on abort, lowest rank."""
    for rank in sorted(errors):
        if not isinstance(errors[rank], (Aborted, PeerFailed)):
            return errors[rank]
    return errors[min(errors)]


class _TimedOut(BaseException):
    """Raised between wait slices once a command outlasted fork(timeout=...)."""

    def __init__(self, ranks):
        super().__init__(ranks)
        self.ranks = list(ranks)


class _CloseRequested(BaseException):
    """Raised between wait slices once close() was called during the command."""


class _GraceOver(BaseException):
    """The workers did not come back within INTERRUPT_GRACE of an abandoned command."""


def _is_stop(err: BaseException) -> bool:
    """Ends the command without meaning that anything failed: Ctrl-C, SystemExit
    from a signal handler, a timeout, close() meanwhile."""
    return not isinstance(err, Exception)


def _closed_meanwhile(what: str) -> SynkError:
    return SynkError(f"synk.close() was called (from another thread or a signal handler) during "
                     f"this {what}; the command was abandoned and the fork is closed")


_session: Session | None = None
#: One command at a time: a call or collective from a second thread waits for
#: the first (re-entrant: a call may distribute first).
_command_lock = threading.RLock()


def serialized(fn):
    """Let one thread at a time into ``fn`` (public calls that talk to the workers)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _command_lock:
            _refuse_nested(fn.__name__)
            return fn(*args, **kwargs)

    return wrapper


def _refuse_nested(what: str) -> None:
    """RuntimeError if this thread is inside a running command already (a signal
    handler or a custom Op's ``perform`` calling synkhronos during a call): the
    re-entrant lock lets it through, and its messages would mix into the
    running command's."""
    s = _session
    if s is not None and s.in_flight == threading.get_ident():
        raise RuntimeError(f"synkhronos {what}() was called while another synkhronos command "
                           "is running in this thread (from a signal handler, or from code "
                           "that a synkhronos function runs); nested commands are not "
                           "supported: make the call after the running one returns")


def session() -> Session:
    """The running fork; RuntimeError before fork() and in a process the user
    forked from the master."""
    if _session is None:
        if _inherited_from is not None:
            raise RuntimeError(
                f"this process (pid {os.getpid()}) was forked from the synkhronos master (pid "
                f"{_inherited_from}) after synk.fork(): the workers belong to that process and "
                "only it can use them; call synk.fork() here to start a fork of this process's own")
        raise RuntimeError("synkhronos is not running: call synk.fork() first")
    return _session


def running() -> bool:
    return _session is not None


def fork(n_parallel: int | None = None, device: str = "auto", master_rank: int = 0,
         pin_cores: bool | None = None, *, use_gpu: bool | None = None,
         profile_workers=False, max_n_var: int | None = None, max_dim: int | None = None,
         timeout: float | None = None) -> int:
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
            ``runtime.WAIT_WARNING_INTERVAL`` seconds, 60). When the time
            runs out the command is abandoned in every process and
            :class:`~synkhronos.SynkTimeoutError` names the ranks that had
            not answered and says whether the runtime is still usable.

    Returns:
        The number of processes, master included.

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
    global _session
    if _session is not None:
        raise RuntimeError("synk.fork() was already called; call synk.close() before forking again")
    timeout = _check_timeout(timeout)
    if pin_cores is not None and not isinstance(pin_cores, bool):
        raise TypeError(f"pin_cores must be True, False or None, got {pin_cores!r}")
    device = _device_for(device, use_gpu)
    for key, limit in (("max_n_var", max_n_var), ("max_dim", max_dim)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise TypeError(f"{key} must be a positive int or None (it is ignored), got {limit!r}")
    profile_dir = _profile_dir(profile_workers)
    n_gpus = gpu.require_gpu() if device == "gpu" else gpu.auto_gpus() if device == "auto" else 0
    if use_gpu and not n_gpus:
        warnings.warn(f"use_gpu=True, but {gpu.no_gpu_reason() or 'no GPU can be used'}: running on "
                      "the CPU (device='gpu' makes this an error)", stacklevel=2)
    device = "gpu" if n_gpus else "cpu"
    cores = available_cores()
    if n_parallel is None:
        n_parallel = n_gpus or cores
    if isinstance(n_parallel, bool) or not isinstance(n_parallel, int):
        raise TypeError(f"n_parallel must be a positive int or None, got {n_parallel!r}")
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be at least 1, got {n_parallel}")
    if n_parallel > cores:
        warnings.warn(f"n_parallel={n_parallel} is more than the {cores} cores available; "
                      "processes will share cores", stacklevel=2)
    if isinstance(master_rank, bool) or not isinstance(master_rank, int):
        raise TypeError(f"master_rank must be an int, got {master_rank!r}")
    if not 0 <= master_rank < n_parallel:
        raise ValueError(f"master_rank must be in [0, {n_parallel}), got {master_rank}")
    gpu_plan = None
    if device == "gpu":
        if n_parallel > n_gpus:
            warnings.warn(f"n_parallel={n_parallel} is more than the {n_gpus} GPUs visible; processes "
                          "will share GPUs and use the CPU (shared-memory) collectives", stacklevel=2)
        gpu_plan = gpu.plan(n_gpus, n_parallel)
        gpu_plan.saved_env = gpu.bind(gpu_plan, master_rank, n_parallel)

    stale = unlink_stale()
    if stale:
        log.info("removed %d shared-memory objects left by synkhronos forks no longer alive", len(stale))
    lease = Lease.new()  # the fork's lock file: created first, unlinked last
    prefix = lease.prefix
    proc = Process(prefix, master_rank, n_parallel, master_rank, device)
    proc.lease = lease
    proc.gpu_plan = gpu_plan
    proc.profile_dir = profile_dir
    try:
        proc.control = ControlBlock(prefix, n_parallel, master_rank, create=True)
        proc.comm = ShmCommunicator(prefix, master_rank, n_parallel, master_rank, create=True)
    except BaseException:
        proc.close()
        unlink_prefix(prefix)
        if gpu_plan is not None:
            gpu.unbind(gpu_plan.saved_env)
        raise
    threads = max(1, cores // n_parallel)
    groups = core_groups(n_parallel) if pin_cores is not False else None
    if pin_cores and groups is None:
        warnings.warn(f"pin_cores=True, but {n_parallel} processes do not fit on {cores} cores "
                      "one each: not pinning", stacklevel=2)
    keep_freed_memory()  # before forking: the workers inherit it
    global _dispositions
    _dispositions = {sig: signal.getsignal(sig) for sig in _FATAL_SIGNALS}  # the workers' rule
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(n_parallel):
        if rank == master_rank:
            continue
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which never returns
            if groups is not None:
                pin(groups[rank])
            _become_worker(proc, rank, threads)
        pids[rank] = pid
    thread_limit = limit_threads(threads)
    _session = Session(proc, pids, thread_limit)
    _session.timeout = timeout
    global _inherited_from
    _inherited_from = None
    _session.saved_handlers = _install_master_handlers()
    if groups is not None:
        _session.saved_affinity = pin(groups[master_rank])
    proc.comm.check = _session.check
    atexit.register(_close_at_exit)
    log.debug("forked %d workers: %s", len(pids), pids)
    if device == "gpu":
        try:
            gpu.start(_session)  # every process opens its GPU; NCCL when each has its own
        except BaseException:
            close()
            raise
    return n_parallel


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds or None, got {timeout!r}")
    return float(timeout)


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


def _set_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, _PARENT_DEATH_SIGNAL, 0, 0, 0)
    except Exception:  # not Linux: the liveness checks still catch a dead master
        pass


def _become_worker(master_proc: Process, rank: int, threads: int) -> None:  # pragma: no cover
    """The forked child's whole life; never returns into the user's script."""
    code = 0
    try:
        _worker_signals()
        _set_parent_death_signal()
        atexit._clear()
        if master_proc.lease is not None:  # the master's descriptor: this worker takes its own
            master_proc.lease.close()
        if master_proc.gpu_plan is not None:  # before anything touches CUDA
            gpu.bind(master_proc.gpu_plan, rank)
        proc = Process(master_proc.prefix, rank, master_proc.size, master_proc.master_rank,
                       master_proc.device)
        proc.gpu_plan = master_proc.gpu_plan
        proc.master_pid = os.getppid()
        if proc.master_pid != master_proc.master_pid:
            os._exit(1)
        proc.lease = Lease(proc.prefix)
        proc.control = ControlBlock(proc.prefix, proc.size, proc.master_rank, create=False)
        proc.comm = ShmCommunicator(proc.prefix, rank, proc.size, proc.master_rank, create=False,
                                    check=proc.check_master)
        interruptible.control = proc.control
        limit_threads(threads, worker=True)
        from .worker.loop import serve, serve_profiled

        if master_proc.profile_dir is None:
            code = serve(proc)
        else:
            code = serve_profiled(proc, master_proc.profile_dir)
    except BaseException:
        code = 1
    finally:
        if _terminate_signal is not None:  # die of the signal, so the master can name it
            try:
                signal.signal(_terminate_signal, signal.SIG_DFL)
                os.kill(os.getpid(), _terminate_signal)
            except BaseException:
                pass
        os._exit(code)


_terminate_requested = False
_terminate_signal = None
_master_died = False
#: Sent to a worker when its master dies: a signal of its own, because the
#: kernel may deliver it before the worker is reparented (getppid() then still
#: names the dead master), and a SIGTERM may also come from close().
_PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 7
#: Sent by the master to a worker still busy with a command it abandoned
#: (Ctrl-C, a timeout, close()): the worker's computation stops at its next
#: Python step. A signal of synkhronos's own, so a user's SIGINT or SIGUSR1
#: means to a worker what the master's disposition says.
_INTERRUPT_SIGNAL = signal.SIGRTMIN + 8
#: Signals whose default action ends a process, as a terminal (hangup, Ctrl-C,
#: Ctrl-backslash), ``timeout``, ``kill`` or a batch scheduler sends them, often to the
#: whole process group. Where the master leaves one at its default, fork()
#: makes it clean up first (end the workers, unlink the shared memory), then
#: die of it as before; where the user handles one, the workers ignore it and
#: the master's handler decides.
_FATAL_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name))
#: The master's dispositions of _FATAL_SIGNALS when it forked (read by the workers).
_dispositions: dict = {}


def _worker_signals() -> None:  # pragma: no cover - worker only
    """A worker dies of a signal only where its master would: it ignores Ctrl-C
    (the master abandons the command and interrupts it) and the signals the
    user handles in the master."""
    for sig in _FATAL_SIGNALS:
        if sig != signal.SIGINT and _dispositions.get(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_terminate)
        else:
            signal.signal(sig, signal.SIG_IGN)
    signal.signal(_PARENT_DEATH_SIGNAL, _on_parent_death)
    signal.signal(_INTERRUPT_SIGNAL, _on_interrupt)


def _on_parent_death(signum, frame):  # pragma: no cover - worker only
    global _master_died, _terminate_requested
    _master_died = _terminate_requested = True
    raise MasterGone()


def _on_terminate(signum, frame):  # pragma: no cover - worker only
    # posix_ipc turns an exception raised in a handler during a semaphore wait
    # into SignalError (which the wait retries): the flag makes the next
    # liveness check end the worker all the same
    global _terminate_requested, _terminate_signal
    _terminate_requested = True
    _terminate_signal = signum
    raise MasterGone()


def _on_interrupt(signum, frame):  # pragma: no cover - worker only
    # only inside the computation, and only while the master has abandoned the
    # command: a late signal must not stop the next one
    if interruptible.armed and interruptible.control is not None and interruptible.control.aborted():
        interruptible.armed = False
        raise Interrupted("the master abandoned this command")


def _install_master_handlers() -> dict:
    """Make the master clean up before it dies of a signal left at its default action."""
    saved = {}
    if threading.current_thread() is not threading.main_thread():
        return saved  # signal handlers can only be set from the main thread
    for sig in _FATAL_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_fatal_signal)
            saved[sig] = signal.SIG_DFL
    return saved


def _restore_master_handlers(saved: dict) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # left in place: with no fork running it only re-raises the signal
    for sig, old in saved.items():
        if signal.getsignal(sig) is _on_fatal_signal:
            signal.signal(sig, old)


def _on_fatal_signal(signum, frame):
    """The master received a signal that ends it: end the workers, unlink, then die of it."""
    s = _session
    if s is not None and os.getpid() == s.pid:
        _emergency_cleanup(s)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # pragma: no cover - the default action ended the process already


def _emergency_cleanup(s: Session) -> None:
    """The master is about to die: no protocol, kill and reap the workers, unlink everything."""
    pending = s.watch.alive()
    s.watch.kill(pending.values(), signal.SIGKILL)
    s.watch.wait(pending, 5.0)
    unlink_prefix(s.proc.prefix)


_inherited_from: int | None = None


def _after_fork_in_child() -> None:
    """In a child the user forked from the master (os.fork, multiprocessing):
    the runtime belongs to the master. Nothing here may drive its workers,
    unlink its shared memory or hold its lock; public calls raise."""
    global _session, _inherited_from
    s = _session
    if s is None:
        return  # also synkhronos's own workers: they are forked before the session exists
    _session = None
    _inherited_from = s.pid
    disown(s.proc.prefix)
    if s.proc.lease is not None:
        s.proc.lease.close()  # this process's copy of the master's descriptor only


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    s = _session
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
    if not _command_lock.acquire(blocking=False):
        _request_close(s)  # the call running in another thread stops at its next wait slice
        _command_lock.acquire()
    try:
        if _session is s:
            _teardown(s)
    finally:
        _command_lock.release()


def _request_close(s: Session) -> None:
    s.close_requested = True
    try:
        s._abort()
        s._interrupt_workers()
    except Exception:  # the control block may be half gone; the waits see the request anyway
        pass


def _teardown(s: Session) -> None:
    """close()'s work. Every step runs even after an earlier one failed or a
    Ctrl-C came; a Ctrl-C is raised at the end."""
    global _session
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
        for fn in s.functions:
            fn._release()
        for d in s.collective_scratch.values():
            d._release()
        for mem in list(s.data_memory.values()):  # Data objects still alive: their arrays stay valid
            mem.release()
        s.data_memory.clear()

    def leave_homes():
        from .shareds import leave_homes

        try:
            leave_homes(proc)
        except Exception:  # the values stay where they are, valid; only their memory lingers
            log.exception("synkhronos: could not copy shared variables out of shared memory")

    if proc.control is not None and proc.control.pending():  # busy with an abandoned command
        step(s._abort)
        step(s._interrupt_workers)
    # also after a failure: live workers finish what they do, then leave
    step(proc.control.post, Command.CLOSE, None)
    step(_reap, s.watch, interrupts)
    step(release_memory)
    step(leave_homes)
    step(proc.close)
    step(unlink_prefix, proc.prefix)
    step(s.thread_limit.restore)
    if s.saved_affinity is not None:
        step(pin, s.saved_affinity)
    if proc.gpu_plan is not None:
        step(gpu.unbind, proc.gpu_plan.saved_env)
    step(_restore_master_handlers, s.saved_handlers)
    step(atexit.unregister, _close_at_exit)
    if _session is s:
        _session = None
    if interrupts:
        raise interrupts[0]


def _reap(watch: ChildWatch, interrupts: list | None = None) -> None:
    """Wait for the workers to leave; SIGTERM, then SIGKILL the ones that don't.

    A Ctrl-C meanwhile (kept in ``interrupts``) goes straight to SIGKILL.
    """
    pending = watch.alive()
    ladder = ((None, CLOSE_GRACE), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0))
    stage = 0
    while pending and stage < len(ladder):
        sig, grace = ladder[stage]
        try:
            if sig is not None:
                for rank, pid in pending.items():
                    log.warning("worker rank %d (pid %d) did not exit; sending %s", rank, pid, sig.name)
                    watch.kill([pid], sig)
            watch.wait(pending, grace)
            stage += 1
        except KeyboardInterrupt as err:
            if interrupts is None:
                raise
            interrupts.append(err)
            stage = len(ladder) - 1


def _close_at_exit() -> None:
    s = _session
    if s is None or os.getpid() != s.pid:  # a child forked from the master: not its fork
        return
    try:
        close()
    except BaseException:  # at exit there is nobody left to tell
        log.exception("synkhronos: close() at exit failed")
