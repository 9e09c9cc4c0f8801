"""The GPU device: the GPU stack, one GPU per process, shared variables and arrays on the device.

Nothing here imports CuPy or JAX at synkhronos import time. The master never
initialises CUDA before it forks: GPUs are counted in a subprocess, and each
process (master included) is bound to its GPU through ``CUDA_VISIBLE_DEVICES``
before anything touches CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys

import numpy as np

from . import context
from .arrays import concat, is_device_array, join, to_cupy, to_jax, to_numpy
from .control import Command, handler
from .collectives.ops import cast_to
from .tuning import restore_env

__all__ = ["stack_missing", "probe", "count_gpus", "gpu_available", "get_n_gpu", "on_device", "to_numpy",
           "to_cupy", "to_jax"]

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
    if _jax_backends_up():
        if n_parallel == 1 and context.bound_gpu == want:
            return ()
        cuda_initialised_error()
    changes = {"CUDA_VISIBLE_DEVICES": want}
    for key, value in _JAX_ENV.items():
        if key not in os.environ and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
            changes[key] = value
    saved = tuple((k, os.environ.get(k)) for k in changes)
    os.environ.update(changes)
    context.bound_gpu = want
    return saved


def unbind(saved: tuple) -> None:
    """Put back the environment entries :func:`bind` replaced."""
    restore_env(saved)


def _jax_backends_up() -> bool:
    if sys.modules.get("jax") is None:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # a JAX without this query: nothing to check against
        return False


def cuda_initialised_error() -> None:
    """RuntimeError if JAX already initialised its backends (CUDA) in this process.

    Forked children cannot use a CUDA context their parent created, and a
    process cannot change its GPU once CUDA is up.
    """
    if _jax_backends_up():
        raise RuntimeError("JAX was already used in this process (its CUDA backend is initialised), "
                           "so synkhronos cannot bind processes to GPUs or fork GPU workers: call "
                           "synk.fork() before any JAX or PyTensor mode='JAX' computation")


# ---------------------------------------------------------------------------
# One process's GPU (every process, after fork).


class GpuState:
    """What one process holds of its GPU: the JAX device and the CuPy device."""

    def __init__(self):
        import cupy
        import jax

        devices = jax.devices()
        if not devices or devices[0].platform not in ("gpu", "cuda"):
            raise RuntimeError(f"JAX found no CUDA device (its devices: {devices}); "
                               f"install JAX with CUDA: {INSTALL_HINT}")
        self.jax_device = devices[0]
        self.cupy_device = cupy.cuda.Device(0)
        self.cupy_device.use()
        self.placed: dict = {}   # sid -> shared variable kept on the device

    def describe(self) -> str:
        return f"{self.jax_device} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"


@dataclasses.dataclass
class InitGpu:
    """The INIT_DEVICE command: first every process opens its GPU, then NCCL."""

    phase: str                  # "device" or "nccl"
    unique_id: tuple | None = None


@handler(Command.INIT_DEVICE)
def _init_gpu(proc, msg: InitGpu) -> None:
    if msg.phase == "device":
        proc.gpu = GpuState()
        log.debug("rank %d uses %s", proc.rank, proc.gpu.describe())
    elif msg.phase == "nccl":
        from .collectives.nccl import NcclCommunicator

        proc.nccl = NcclCommunicator(proc.comm, msg.unique_id)
    else:
        raise ValueError(f"unknown INIT_DEVICE phase {msg.phase!r}")


def start(session) -> None:
    """Master-side, right after fork: open the GPU in every process, then NCCL if planned."""
    session.run(Command.INIT_DEVICE, InitGpu("device"), _init_gpu)
    if session.proc.gpu_plan.nccl:
        from .collectives.nccl import new_unique_id

        session.run(Command.INIT_DEVICE, InitGpu("nccl", new_unique_id()), _init_gpu)


# ---------------------------------------------------------------------------
# Shared variables on the device.


def _uses_jax(fn) -> bool:
    from pytensor.link.jax.linker import JAXLinker

    return isinstance(getattr(fn.maker, "linker", None), JAXLinker)


def place_shareds(proc) -> None:
    """Move to the device the shared variables that only JAX-mode functions use.

    Variables also read by a function of another mode (C, Python, Numba) stay
    in host memory, where those functions expect them.
    """
    if getattr(proc, "gpu", None) is None:
        return
    on_jax, elsewhere = set(), set()
    for lf in proc.functions.values():
        fn = lf.compiled()
        used = {id(inp.variable) for inp in fn.maker.inputs if inp.shared}
        used |= {id(v) for v in lf.spec.sliceable}
        (on_jax if _uses_jax(fn) else elsewhere).update(used)
    for sid, var in proc.shareds.items():
        if id(var) in on_jax and id(var) not in elsewhere:
            proc.gpu.placed[sid] = var
    keep_on_device(proc)


def keep_on_device(proc) -> None:
    """Put back on the device any placed shared variable whose value is in host memory
    (after ``set_value``, a CPU collective, or updates accumulated over slices)."""
    if getattr(proc, "gpu", None) is None or not proc.gpu.placed:
        return
    import jax

    for var in proc.gpu.placed.values():
        value = var.container.storage[0]
        if isinstance(value, np.ndarray):
            # straight into the storage: set_value would filter it back to numpy
            var.container.storage[0] = jax.device_put(value, proc.gpu.jax_device)


def _store(proc, sid, var, value) -> None:
    """Make ``value`` (a CuPy array) the value of ``var``: on the device for a placed
    variable, in host memory for the others."""
    value = cast_to(value, var.type.dtype)  # rounded into integers, never truncated
    if sid in proc.gpu.placed:
        var.container.storage[0] = to_jax(value)
    else:
        var.set_value(to_numpy(value), borrow=True)


#: Shared-variable collectives that go through NCCL when there is an NCCL communicator.
_NCCL_KINDS = ("broadcast", "gather", "all_gather", "reduce", "all_reduce")


def on_device(shared_vars):
    """Where every process keeps the values of shared variables (GPU device only).

    Returns, per variable, a boolean array over ranks: True where that
    process holds the value as a device (JAX) array, False where it is in
    host memory. A single variable gives a single array.

    Raises:
        RuntimeError: not a GPU device.
    """
    from .shareds import CollectiveSpec, _resolve, _run

    s, _, sids, single = _resolve(shared_vars)
    if s.proc.gpu is None:
        raise RuntimeError("on_device() needs a GPU device: synk.fork(device='gpu')")
    got = s.run(Command.COLLECTIVE, CollectiveSpec("placement", sids), _run)
    return got[0] if single else got


def run_shared_collective(proc, spec, host_run):
    """A collective on shared variables in a GPU process.

    Through NCCL, on the values where they are, when every process has a GPU
    of its own; otherwise (shared GPUs, a ``c_`` op, scatter, set_value,
    get_value, get_shapes) through ``host_run``, the CPU path: values go to
    host memory and the placed ones back to the device afterwards. The
    master gets numpy arrays back either way.
    """
    if spec.kind == "placement":
        flags = np.array([is_device_array(proc.shareds[sid].container.storage[0]) for sid in spec.sids])
        got = proc.comm.gather([flags], root=proc.master_rank)
        if got is None:
            return None
        return [np.array([per_rank[i] for per_rank in got[0]]) for i in range(len(spec.sids))]
    nccl = proc.nccl
    try:
        if nccl is None or spec.kind not in _NCCL_KINDS or spec.cpu:
            return host_run(proc, spec)
        return _nccl_shared_collective(proc, nccl, spec)
    finally:
        keep_on_device(proc)  # also a value the master was given (broadcast, set_value)


def _nccl_shared_collective(proc, nccl, spec):
    vars_ = [proc.shareds[sid] for sid in spec.sids]
    values = [v.container.storage[0] for v in vars_]
    root, kind = proc.master_rank, spec.kind
    if kind == "broadcast":
        got = nccl.broadcast(values if proc.is_master else None, root=root)
        if not proc.is_master:
            for sid, v, g in zip(spec.sids, vars_, got):
                _store(proc, sid, v, g)
    elif kind == "gather":
        return nccl.gather(values, root=root, join=lambda i, parts: join(
            [to_numpy(p) for p in parts], spec.nd_up, vars_[i]))
    elif kind == "all_gather":
        got = nccl.all_gather(values, join=lambda i, parts: concat(parts))
        for sid, v, g in zip(spec.sids, vars_, got):
            _store(proc, sid, v, g)
        return [to_numpy(g) for g in got] if proc.is_master else None
    elif kind == "reduce":
        got = nccl.reduce(values, spec.op, root=root)
        if got is not None and proc.is_master:
            if spec.in_place:
                for sid, v, g in zip(spec.sids, vars_, got):
                    _store(proc, sid, v, g)
            return [cast_to(to_numpy(g), v.type.dtype) for g, v in zip(got, vars_)]
    elif kind == "all_reduce":
        got = nccl.all_reduce(values, spec.op)
        for sid, v, g in zip(spec.sids, vars_, got):
            _store(proc, sid, v, g)
    return None


def output_comms(proc, spec, subset) -> list | None:
    """Each output's communicator in a call: NCCL where there is one, except for
    ``c_`` ops and functions built with ``nccl=False``; None on a CPU device."""
    nccl = getattr(proc, "nccl", None)
    if nccl is None:
        return None
    modes = spec.output_modes or spec.output_ops
    return [proc.comm if not spec.nccl or (isinstance(modes[i], str) and modes[i].startswith("c_"))
            else nccl for i in subset]


def convert_outputs(results, device_outputs: bool, device=None) -> list:
    """The master's outputs: numpy arrays, or JAX arrays on ``device`` with ``device_outputs``."""
    if device_outputs:
        return [None if r is None else to_jax(r, device) for r in results]
    return [to_numpy(r) for r in results]
