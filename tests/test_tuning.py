"""synkhronos._procs.cores and .xla_flags: what each process is told about its threads."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from synkhronos._procs.xla_flags import cpu_has_avx512, xla_flags


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("given", ["", "--xla_dump_to=/tmp/x", "--xla_cpu_multi_thread_eigen=true",
                                   "--xla_cpu_prefer_vector_width=256"])
def test_xla_flags_are_all_flags_xla_knows(given, n):
    """XLA reads a first token without "--" as a file of flags and aborts the process
    (a GPU machine's workers died so, on "intra_op_parallelism_threads=8")."""
    flags = xla_flags(given, n)
    assert all(tok.startswith("--") for tok in flags.split()), flags
    assert flags.startswith(given)
    assert ("--xla_cpu_multi_thread_eigen=false" in flags) == (n == 1 and "eigen" not in given), flags
    assert ("--xla_cpu_prefer_vector_width=512" in flags) == (cpu_has_avx512() and "vector_width" not in given)
    assert flags.count("vector_width") <= 1, flags


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
@pytest.mark.parametrize("n", [1, 4])
def test_jax_starts_with_the_flags(n):
    env = {**os.environ, "XLA_FLAGS": xla_flags("", n), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-2000:]


def test_avx512_is_read_from_cpuinfo():
    """The 512-bit vectors follow the CPU: /proc/cpuinfo's flags, read once."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    assert cpu_has_avx512() == ("avx512f" in flags)
