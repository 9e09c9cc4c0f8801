"""The GPU stack without CUDA: find CuPy and JAX, count the GPUs in a
subprocess, plan which process uses which GPU, and bind each process to its
GPU through ``CUDA_VISIBLE_DEVICES`` before anything touches CUDA.

Nothing here imports CuPy or JAX in this process: the master never initialises
CUDA before it forks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys

from .. import _state as state
from .._procs.cores import restore_env

from .jax_state import jax_backends_up

__all__ = []

log = logging.getLogger("synkhronos")

#: The packages of the GPU stack, as imported.
STACK = ("cupy", "jax")
INSTALL_HINT = "pip install synkhronos[gpu]"
#: Seconds the GPU probe subprocess may take (importing JAX is slow).
PROBE_TIMEOUT = 120.0

_PROBE_CODE = r"""
import json, sys
out = {"missing": {}, "n_gpus": 0, "error": None}
for name in ("cupy", "jax"):
    try:
        __import__(name)
    except Exception as exc:
        out["missing"][name] = f"{type(exc).__name__}: {exc}"
if "cupy" not in out["missing"]:
    try:
        import cupy
        out["n_gpus"] = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
sys.stdout.write(json.dumps(out))
"""


# ---------------------------------------------------------------------------
# Finding the stack and the GPUs (master, before fork).


def stack_missing() -> list[str]:
    """The packages of the GPU stack that cannot be found (nothing is imported)."""
    return [name for name in STACK if importlib.util.find_spec(name) is None]


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a subprocess found: GPUs visible to CuPy, stack packages that failed to import."""

    n_gpus: int
    missing: dict          # package -> why its import failed
    error: str | None      # why the GPUs could not be counted, if they could not


_probe_cache: dict = {}


def probe(refresh: bool = False) -> Probe:
    """Import the GPU stack and count the GPUs in a subprocess.

    CUDA is initialised in the subprocess only, so the calling process can
    still fork. The answer is cached per value of ``CUDA_VISIBLE_DEVICES``.
    """
    key = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not refresh and key in _probe_cache:
        return _probe_cache[key]
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_CODE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT)
        found = json.loads(done.stdout)
        result = Probe(int(found["n_gpus"]), dict(found["missing"]), found["error"])
    except subprocess.TimeoutExpired:
        result = Probe(0, {}, f"the GPU probe took more than {PROBE_TIMEOUT:.0f} s")
    except (ValueError, KeyError, OSError) as exc:
        result = Probe(0, {}, f"the GPU probe failed: {exc}")
    _probe_cache[key] = result
    return result


def count_gpus() -> int:
    """GPUs visible to this process (counted in a subprocess; 0 without the stack)."""
    if stack_missing():
        return 0
    return probe().n_gpus


def gpu_available() -> bool:
    """The GPU stack imports and at least one GPU is visible."""
    return count_gpus() > 0


def no_gpu_reason() -> str | None:
    """Why this process cannot use a GPU, or None when it can (the stack is probed in a subprocess)."""
    missing = stack_missing()
    if missing:
        return f"{' and '.join(missing)} could not be found ({INSTALL_HINT})"
    found = probe()
    if found.missing:
        return f"{' and '.join(found.missing)} could not be imported ({INSTALL_HINT})"
    if found.n_gpus < 1:
        return f"no GPU is visible ({found.error or 'CuPy counts none'})"
    return None


def get_n_gpu() -> int:
    """The number of GPUs this process can use, as the original Synkhronos's ``get_n_gpu``.

    Counted in a subprocess, so CUDA never starts here (a later
    :func:`synkhronos.fork` can still fork); nothing is imported when the GPU
    stack is absent.

    Returns:
        The GPUs visible to this process; 0 without the GPU stack (CuPy and
        JAX) or without a GPU. After ``fork(device="gpu")`` each process sees
        the GPU it was bound to.

    Raises:
        Nothing: a failed probe counts as 0 GPUs.
    """
    return 0 if no_gpu_reason() is not None else probe().n_gpus


def require_gpu() -> int:
    """The number of visible GPUs; RuntimeError naming what is missing when there are none."""
    missing = stack_missing()
    if missing:
        raise RuntimeError(f"device='gpu' needs {' and '.join(missing)}, which could not be "
                           f"imported: {INSTALL_HINT}")
    found = probe()
    if found.missing:
        why = "; ".join(f"{k}: {v}" for k, v in found.missing.items())
        raise RuntimeError(f"device='gpu' needs {' and '.join(found.missing)}, which could not be "
                           f"imported ({why}): {INSTALL_HINT}")
    if found.n_gpus < 1:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        mask = "" if seen is None else f" with CUDA_VISIBLE_DEVICES={seen!r}"
        why = f" ({found.error})" if found.error else ""
        raise RuntimeError(f"device='gpu' but no GPU is visible{mask}{why}; use device='cpu' "
                           "or device='auto'")
    return found.n_gpus


def auto_gpus() -> int:
    """For ``device='auto'``: the number of GPUs to use, 0 for the CPU device."""
    missing = stack_missing()
    if missing:
        log.info("device='auto': %s not installed, using the CPU", " and ".join(missing))
        return 0
    found = probe()
    if found.missing or found.n_gpus < 1:
        log.info("device='auto': no usable GPU (%s), using the CPU",
                 found.missing or found.error or "none visible")
        return 0
    return found.n_gpus


# ---------------------------------------------------------------------------
# Binding processes to GPUs (before CUDA is touched).


@dataclasses.dataclass
class GpuPlan:
    """How the processes of one fork use the GPUs.

    Attributes:
        visible: the GPU ids this fork may use (entries of the master's
            ``CUDA_VISIBLE_DEVICES``, or ``0..n-1``).
        nccl: every process has a GPU of its own, so collectives may go
            through NCCL; otherwise processes share GPUs and use the CPU ones.
        saved_env: the master's environment entries changed by :func:`bind`,
            restored at close.
    """

    visible: tuple
    nccl: bool
    saved_env: tuple = ()

    def gpu_of(self, rank: int) -> str:
        return self.visible[rank % len(self.visible)]


def plan(n_gpus: int, n_parallel: int) -> GpuPlan:
    """Which GPU each rank gets: rank r uses GPU ``r % n_gpus``."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in mask.split(",") if d.strip()] if mask else []
    if len(ids) < n_gpus:
        ids = [str(i) for i in range(n_gpus)]
    return GpuPlan(tuple(ids[:n_gpus]), nccl=n_parallel <= n_gpus)


#: Environment set in every GPU process unless the user set it: JAX must not
#: take the whole card, CuPy and NCCL need memory too.
_JAX_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def bind(gpu_plan: GpuPlan, rank: int, n_parallel: int | None = None) -> tuple:
    """Make GPU ``gpu_plan.gpu_of(rank)`` the only one this process sees.

    Must run before anything in this process initialises CUDA; the one
    exception is a master that forks one process again, after ``close()``,
    on the GPU it was bound to before (``n_parallel`` 1). Returns the
    environment entries it replaced, as ``((name, old value or None), ...)``.

    Raises:
        RuntimeError: CUDA is already up in this process (through JAX).
    """
    want = gpu_plan.gpu_of(rank)
    if jax_backends_up():
        if n_parallel == 1 and state.bound_gpu == want:
            return ()
        cuda_initialised_error()
    changes = {"CUDA_VISIBLE_DEVICES": want}
    for key, value in _JAX_ENV.items():
        if key not in os.environ and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
            changes[key] = value
    saved = tuple((k, os.environ.get(k)) for k in changes)
    os.environ.update(changes)
    state.bound_gpu = want
    return saved


def unbind(saved: tuple) -> None:
    """Put back the environment entries :func:`bind` replaced."""
    restore_env(saved)


def cuda_initialised_error() -> None:
    """RuntimeError if JAX already initialised its backends (CUDA) in this process.

    Forked children cannot use a CUDA context their parent created, and a
    process cannot change its GPU once CUDA is up.
    """
    if jax_backends_up():
        raise RuntimeError("JAX was already used in this process (its CUDA backend is initialised), "
                           "so synkhronos cannot bind processes to GPUs or fork GPU workers: call "
                           "synk.fork() before any JAX or PyTensor mode='JAX' computation")
