"""fork() and close(): the processes of one fork, and each process's state."""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
import warnings

from . import gpu
from .collectives import PeerFailed, ShmCommunicator
from .control import Aborted, ChildWatch, Command, ControlBlock, MasterGone
from .errors import SynkError, WorkerDiedError, unpack_exception
from .shmem import new_prefix, unlink_prefix, unlink_stale
from .memory import keep_freed_memory
from .threads import available_cores, core_groups, limit_threads, pin

__all__ = ["fork", "close"]

log = logging.getLogger("synkhronos")

_DEVICES = ("auto", "cpu", "gpu")
#: Seconds the master waits for workers to leave at close() before SIGTERM, then SIGKILL.
CLOSE_GRACE = 2.0


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

    @property
    def n_parallel(self) -> int:
        return self.proc.size

    def poll(self) -> None:
        """Raise WorkerDiedError (and mark the fork broken) if a worker has died."""
        try:
            self.watch.poll()
        except WorkerDiedError as err:
            self.broken = err
            self.proc.control.set_abort(True)
            raise

    def check(self) -> None:
        """Master-side check between wait slices inside a collective."""
        self.poll()
        if any(self.proc.control._status[r] for r in self.proc.control.go):
            # a worker failed outside a collective's own error protocol: free the others
            self.proc.control.set_abort(True)
            raise Aborted("a worker failed during a collective")

    def usable(self) -> None:
        if self.broken is not None:
            raise SynkError(f"synkhronos is unusable after an earlier failure ({self.broken}); "
                            "call synk.close() and synk.fork() again")

    def run(self, cmd: Command, payload, local=None):
        """Send ``cmd`` to every worker, run ``local(proc, payload)`` here, wait for all.

        Returns what ``local`` returned; raises the most telling error of any
        process (a worker's carries its rank and traceback).
        """
        self.usable()
        ctl = self.proc.control
        dropped, self.dropped = self.dropped, []
        ctl.post(cmd, (dropped, payload))
        result = local_err = None
        aborted = False
        try:
            if local is not None:
                result = local(self.proc, payload)
        except WorkerDiedError:
            raise
        except BaseException as err:  # also KeyboardInterrupt: free the workers, then re-raise
            local_err = err
            if not isinstance(err, PeerFailed):
                ctl.set_abort(True)
                aborted = True
        try:
            errors = ctl.collect(self.poll)
        except WorkerDiedError:
            raise
        except BaseException as err:
            self.broken = err
            raise
        if aborted or errors:
            self.proc.comm.reset()
            ctl.new_epoch()
            ctl.set_abort(False)
        if isinstance(local_err, KeyboardInterrupt):
            raise local_err
        unpacked = {rank: unpack_exception(blob) for rank, blob in errors.items()}
        if local_err is not None:
            unpacked[self.proc.rank] = local_err
        if unpacked:
            raise _most_telling(unpacked)
        return result


def _most_telling(errors: dict):
    """The root cause among the processes' errors: not a follow-on abort, lowest rank."""
    for rank in sorted(errors):
        if not isinstance(errors[rank], (Aborted, PeerFailed)):
            return errors[rank]
    return errors[min(errors)]


_session: Session | None = None
#: One command at a time: a call or collective from a second thread waits for
#: the first (re-entrant: a call may distribute first).
_command_lock = threading.RLock()


def serialized(fn):
    """Let one thread at a time into ``fn`` (public calls that talk to the workers)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _command_lock:
            return fn(*args, **kwargs)

    return wrapper


def session() -> Session:
    """The running fork; RuntimeError before fork()."""
    if _session is None:
        raise RuntimeError("synkhronos is not running: call synk.fork() first")
    return _session


def running() -> bool:
    return _session is not None


def fork(n_parallel: int | None = None, device: str = "auto", master_rank: int = 0,
         pin_cores: bool | None = None) -> int:
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
    if pin_cores is not None and not isinstance(pin_cores, bool):
        raise TypeError(f"pin_cores must be True, False or None, got {pin_cores!r}")
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    n_gpus = gpu.require_gpu() if device == "gpu" else gpu.auto_gpus() if device == "auto" else 0
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
        log.info("removed %d shared-memory objects left by dead synkhronos masters", len(stale))
    prefix = new_prefix()
    proc = Process(prefix, master_rank, n_parallel, master_rank, device)
    proc.gpu_plan = gpu_plan
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(_PARENT_DEATH_SIGNAL, _on_parent_death)
        _set_parent_death_signal()
        atexit._clear()
        if master_proc.gpu_plan is not None:  # before anything touches CUDA
            gpu.bind(master_proc.gpu_plan, rank)
        proc = Process(master_proc.prefix, rank, master_proc.size, master_proc.master_rank,
                       master_proc.device)
        proc.gpu_plan = master_proc.gpu_plan
        proc.master_pid = os.getppid()
        if proc.master_pid != master_proc.master_pid:
            os._exit(1)
        proc.control = ControlBlock(proc.prefix, proc.size, proc.master_rank, create=False)
        proc.comm = ShmCommunicator(proc.prefix, rank, proc.size, proc.master_rank, create=False,
                                    check=proc.check_master)
        limit_threads(threads, worker=True)
        from .worker.loop import serve

        code = serve(proc)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


_terminate_requested = False
_master_died = False
#: Sent to a worker when its master dies: a signal of its own, because the
#: kernel may deliver it before the worker is reparented (getppid() then still
#: names the dead master), and a SIGTERM may also come from close().
_PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 7


def _on_parent_death(signum, frame):  # pragma: no cover - worker only
    global _master_died, _terminate_requested
    _master_died = _terminate_requested = True
    raise MasterGone()


def _on_sigterm(signum, frame):  # pragma: no cover - worker only
    # posix_ipc turns an exception raised in a handler during a semaphore wait
    # into SignalError (which the wait retries): the flag makes the next
    # liveness check end the worker all the same
    global _terminate_requested
    _terminate_requested = True
    raise MasterGone()


def close() -> None:
    """End every worker and unlink every segment and semaphore of this fork.

    Safe to call twice, after a failure, and before fork() (then it does
    nothing). ``fork()`` works again afterwards. Also runs at interpreter exit.
    Workers get a grace period to leave, then SIGTERM, then SIGKILL.

    Args:
        None.

    Returns:
        None.

    Raises:
        Nothing: what cannot be closed cleanly is killed and logged.
    """
    global _session
    s = _session
    if s is None:
        return
    _session = None
    proc = s.proc
    try:  # also after a failure: live workers finish what they do, then leave
        proc.control.post(Command.CLOSE, None)
    except Exception:
        pass
    _reap(s.watch)
    for fn in s.functions:
        fn._release()
    for d in s.collective_scratch.values():
        d._release()
    proc.close()
    unlink_prefix(proc.prefix)
    s.thread_limit.restore()
    if s.saved_affinity is not None:
        pin(s.saved_affinity)
    if proc.gpu_plan is not None:
        gpu.unbind(proc.gpu_plan.saved_env)
    try:
        atexit.unregister(_close_at_exit)
    except Exception:
        pass


def _reap(watch: ChildWatch) -> None:
    """Wait for the workers to leave; SIGTERM, then SIGKILL the ones that don't."""
    pending = {r: p for r, p in watch.pids.items() if r not in watch.exited}
    for sig, grace in ((None, CLOSE_GRACE), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            for rank, pid in pending.items():
                log.warning("worker rank %d (pid %d) did not exit; sending %s", rank, pid, sig.name)
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while pending and time.monotonic() < end:
            for rank, pid in list(pending.items()):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    del pending[rank]
            if pending:
                time.sleep(0.002)
        if not pending:
            return


def _close_at_exit() -> None:
    try:
        close()
    except Exception:  # at exit there is nobody left to tell
        log.exception("synkhronos: close() at exit failed")
