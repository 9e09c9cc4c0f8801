"""Tuning of this process: its share of the cores (BLAS, OpenMP and Numba
threads, CPU affinity), its environment, and glibc's handling of freed memory.

Keeping freed heap memory: by default glibc serves every allocation above
32 MiB (less, at first) with a fresh mmap and gives it back on free: the next
array of that size pays a page fault for each of its pages, which costs as
much as a copy of the data again. Collectives and reductions allocate such
arrays at every call. Serving them from the heap and not trimming it (as MPI
implementations do with their own allocators) halves the cost of a 64 MiB
gather or broadcast. Set ``SYNKHRONOS_KEEP_FREED_MEMORY=0`` to leave the
allocator as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from .xla_flags import xla_flags

__all__ = []

log = logging.getLogger("synkhronos")

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

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
    if worker and "jax" not in sys.modules:  # JAX reads it when its CPU backend starts
        os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), n)
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
            restore_env(saved_env.items())
            if saved_numba is not None and numba is not None:  # (saved only where numba is)
                try:
                    numba.set_num_threads(saved_numba)
                except Exception:
                    pass

    return _Handle()


def restore_env(saved) -> None:
    """Put back environment entries: ``(key, value)`` pairs, a value of None
    meaning the key was not set."""
    for key, value in saved:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def keep_freed_memory() -> bool:
    """Tune glibc's malloc in this process (and the ones it forks); True if it did.

    Calling it again does no harm: mallopt sets the same values."""
    if os.environ.get("SYNKHRONOS_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1  # an int: 2 GiB
    except (OSError, AttributeError):  # not glibc
        return False
    if not ok:
        log.debug("mallopt refused; the allocator is left as it is")
    return ok
