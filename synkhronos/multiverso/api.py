"""``init``, ``shutdown``, ``barrier`` and the worker ids; the one place that picks the backend."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .. import _state
from .._procs.launch import launched
from ..errors import SynkError
from .shm_tables import ShmStore
from .spmd import ForkedWorld

if TYPE_CHECKING:
    from .mpi_world import MpiWorld

__all__ = ["init", "shutdown", "barrier", "workers_num", "worker_id", "server_id",
           "is_master_worker", "under_launcher"]



class _State:
    """What ``init()`` made in this process."""

    def __init__(self, world: ForkedWorld | MpiWorld, sync: bool):
        self.world = world
        self.sync = sync
        self.tables: list = []
        self.down = False
        self.limiter = None



def under_launcher() -> bool:
    """True when an MPI launcher started this process (then every rank is a worker),
    unless ``SYNKHRONOS_NODES=0`` keeps it to itself, as for ``synk.fork()``."""
    return launched()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _gpus() -> int:
    """Visible NVIDIA GPUs, without importing a GPU stack: ``CUDA_VISIBLE_DEVICES``
    when set, else the GPUs the driver lists (0 without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _default_workers() -> int:
    """One worker per visible GPU when there are GPUs, else one per core."""
    return _gpus() or _cores()


def _make_world(num_workers: int | None) -> ForkedWorld | MpiWorld:
    """The backend, chosen here and only here: MPI under a launcher, else forked workers."""
    if under_launcher():
        from .mpi_world import MpiWorld  # imports mpi4py: only under a launcher

        world = MpiWorld()
        if num_workers is not None and num_workers != world.size:
            world.shutdown()
            raise ValueError(f"num_workers={num_workers!r} but the launcher started {world.size} "
                             "processes; leave num_workers out under mpirun")
        return world
    n = _default_workers() if num_workers is None else num_workers
    forked = ForkedWorld(n, ShmStore)
    forked.start()
    return forked


def init(sync: bool = False, num_workers: int | None = None) -> None:
    """Start the workers and the parameter server (Multiverso's ``MV_Init``).

    Without a launcher this forks ``num_workers - 1`` processes, and every one
    of them runs the rest of the script, exactly as if ``mpirun`` had started
    them (SPMD); this process is worker 0, the master. Under ``mpirun`` (or
    another MPI launcher) every launched process is a worker and nothing is
    forked.

    Args:
        sync: True for a sync server (every worker calls ``add`` and ``get`` in
            the same order and the same number of times; the i-th ``get`` of
            every worker returns the same values); False (the default) for an
            async server (adds are applied as they arrive; ``barrier()``
            flushes).
        num_workers: the number of workers to fork; default one per visible
            GPU (``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list), or
            one per CPU core this process may run on when there is no GPU.
            Under a launcher, leave it out (or give the launcher's number of
            processes).

    Raises:
        SynkError: ``init`` was already called in this process.
        TypeError: ``num_workers`` is not an int.
        ValueError: ``num_workers`` is below 1, or differs from the launcher's.
    """
    if _state.multiverso_started():
        raise SynkError("multiverso.init() was already called in this process; call it once, "
                        "at the start of the script")
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    if num_workers is not None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int):
            raise TypeError(f"num_workers must be an int, got {num_workers!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    world = _make_world(num_workers)
    state = _State(world, sync)
    if world.size > 1 and world.kind == "fork":
        from threadpoolctl import threadpool_limits  # each worker gets its share of the cores

        state.limiter = threadpool_limits(max(1, _cores() // world.size))
    _state.set_multiverso_server(state)


def current(what: str) -> _State:
    """The running state, or a clear error naming the call ``what``."""
    state = _state.multiverso_server()
    if state is None:
        raise SynkError(f"{what} was called before multiverso.init()")
    if state.down:
        raise SynkError(f"{what} was called after multiverso.shutdown()")
    return state


def shutdown() -> None:
    """Leave the parameter server (Multiverso's ``MV_ShutDown``).

    Waits until every worker has called ``shutdown()`` (or ended its script),
    then frees the tables. A worker that shut down counts as finished: sync
    gets of the others no longer wait for it. Tables cannot be used after.

    Raises:
        SynkError: called before ``init()`` or twice.
        WorkerFailedError: another worker raised an exception or died.
    """
    state = current("multiverso.shutdown()")
    try:
        state.world.shutdown()
    finally:
        state.down = True
        for table in state.tables:
            table.free()
        state.tables.clear()


def barrier() -> None:
    """Wait until every worker calls ``barrier()``; every add issued before it
    is then seen by every worker's ``get``.

    Raises:
        SynkError: called before ``init()`` or after ``shutdown()``, or another
            worker has shut down and will never reach the barrier.
        WorkerFailedError: another worker raised an exception or died.
    """
    current("multiverso.barrier()").world.barrier("barrier()")


def workers_num() -> int:
    """The number of workers.

    Raises:
        SynkError: called before ``init()``.
    """
    return _ids("workers_num()").size


def worker_id() -> int:
    """This worker's id, zero-based.

    Raises:
        SynkError: called before ``init()``.
    """
    return _ids("worker_id()").rank


def server_id() -> int:
    """This process's server id: every worker also serves a share of every
    table (Multiverso's default roles), so it equals :func:`worker_id`.

    Raises:
        SynkError: called before ``init()``.
    """
    return _ids("server_id()").rank


def is_master_worker() -> bool:
    """True in worker 0, the master (for validation, printing, saving).

    Raises:
        SynkError: called before ``init()``.
    """
    return _ids("is_master_worker()").rank == 0


def _ids(what: str) -> ForkedWorld | MpiWorld:
    state = _state.multiverso_server()
    if state is None:
        raise SynkError(f"{what} was called before multiverso.init()")
    return state.world
