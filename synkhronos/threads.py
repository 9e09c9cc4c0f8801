"""Keep each process to its share of the cores (BLAS, OpenMP and Numba threads)."""

from __future__ import annotations

import os
import sys

__all__ = []

_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
             "NUMBA_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


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


def limit_threads(n: int):
    """Cap native thread pools at ``n``; returns a handle whose ``restore()`` undoes it."""
    from threadpoolctl import threadpool_limits

    saved_env = {k: os.environ.get(k) for k in _ENV_VARS}
    for key in _ENV_VARS:
        os.environ[key] = str(n)
    limits = threadpool_limits(limits=n)
    numba = sys.modules.get("numba")
    saved_numba = None
    if numba is not None:
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
