"""XLA's flags for a process's share of the cores: its CPU thread pool and vector
width (every worker's, set by :func:`.cores.limit_threads`; the master's share of a
PyMC model in JAX mode, by synkhronos.pymc)."""

from __future__ import annotations

import functools

__all__ = []


def xla_flags(flags: str, n: int) -> str:
    """``flags`` (XLA_FLAGS) for a process of ``n`` cores: one core runs XLA's CPU work
    without Eigen's thread pool, and on a CPU with AVX-512 XLA emits 512-bit vectors,
    unless ``flags`` say otherwise already.

    XLA has no flag for a pool of ``n > 1`` threads; it sizes its pool by the
    cores this process may run on, which :mod:`synkhronos._procs.cores` binds. Every
    token is a ``--flag``: XLA reads a first token without ``--`` as a file of
    flags and aborts the process when there is none (it did, on a GPU machine,
    for ``intra_op_parallelism_threads=8``), and aborts on a flag it does not know.

    XLA prefers 256-bit vectors by default (older Intel CPUs lower their clock
    under AVX-512 work). On one core of an Intel Xeon with AVX-512 (2026-11-26),
    JAX's value and gradient of a logistic regression over 100,000 rows took
    3.9 ms with 512-bit vectors against 4.6 ms (4 interleaved rounds), with the
    same results to rounding; ``--xla_cpu_prefer_vector_width=256`` in
    ``XLA_FLAGS`` keeps XLA's default.
    """
    tokens = [flags]
    if n == 1 and "xla_cpu_multi_thread_eigen" not in flags:
        tokens.append("--xla_cpu_multi_thread_eigen=false")
    if "xla_cpu_prefer_vector_width" not in flags and cpu_has_avx512():
        tokens.append("--xla_cpu_prefer_vector_width=512")
    return " ".join(tokens).strip()


@functools.lru_cache(maxsize=1)
def cpu_has_avx512() -> bool:
    """Whether this machine's CPUs have AVX-512 (the ``avx512f`` flag in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split()
    except OSError:
        pass
    return False
