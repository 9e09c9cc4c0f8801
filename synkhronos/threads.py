"""Keep each process to its share of the cores (BLAS, OpenMP and Numba threads)."""

from __future__ import annotations

import os
import sys

__all__ = []

#: Read by the BLAS and OpenMP libraries when they load (a process forked
#: later inherits them). Numba's NUMBA_NUM_THREADS is handled apart: Numba
#: refuses any change to it once its threads run, at its next compile.
_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
             "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def core_groups(n_parallel: int):
    """Split this process's cores into ``n_parallel`` disjoint groups, one per rank;
    None when there are fewer cores than processes (then nobody is pinned)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    if n_parallel > len(cores):
        return None
    size = len(cores) // n_parallel
    return [set(cores[r * size:(r + 1) * size]) for r in range(n_parallel)]


def pin(cores) -> set | None:
    """Run this process on ``cores`` only; returns the affinity it had (None if unsupported)."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
        return before
    except (AttributeError, OSError):
        return None


def _numba_threads_running() -> bool:
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(getattr(parallel, "_is_initialized", False))


def limit_threads(n: int, worker: bool = False):
    """Cap native thread pools at ``n``; returns a handle whose ``restore()`` undoes it.

    In a worker (which never restores) Numba's thread count is capped too:
    through NUMBA_NUM_THREADS before its threads start, else with
    ``numba.set_num_threads``. In the master Numba is capped only if its
    threads already run (so the cap can be undone): starting them here would
    fix their number for the rest of the process.
    """
    from threadpoolctl import threadpool_limits

    saved_env = {k: os.environ.get(k) for k in _ENV_VARS}
    for key in _ENV_VARS:
        os.environ[key] = str(n)
    limits = threadpool_limits(limits=n)
    numba = sys.modules.get("numba")
    saved_numba = None
    if worker and not _numba_threads_running():
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        if numba is not None:
            numba.config.reload_config()
    elif numba is not None and _numba_threads_running():
        try:
            saved_numba = numba.get_num_threads()
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        except Exception:  # numba's threading layer may not be usable here
            saved_numba = None

    class _Handle:
        @staticmethod
        def restore():
            limits.restore_original_limits()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if saved_numba is not None:
                try:
                    numba.set_num_threads(saved_numba)
                except Exception:
                    pass

    return _Handle()
