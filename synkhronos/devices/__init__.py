"""Devices: what a fork computes on, and the one place fork() chooses it."""

from __future__ import annotations

import warnings

from .. import context
from ..errors import user_stacklevel
from . import gpu_stack
from .base import Device
from .cpu import CpuDevice
from .gpu import GpuDevice

__all__ = ["Device", "CpuDevice", "GpuDevice", "DEVICES", "choose", "create"]

#: ``fork(device=...)`` name -> Device class.
DEVICES = {"cpu": CpuDevice, "gpu": GpuDevice}
#: What ``device="auto"`` tries, in order: the first with units to use, else the last.
AUTO = ("gpu", "cpu")
#: Whether the GPU path has run on a real GPU: until it has, ``device="auto"`` warns
#: (once per process) when it picks the GPU (see docs/gpu-validation.rst).
GPU_VALIDATED = False
UNVALIDATED_GPU = ("device='auto' chose the GPU: synkhronos's GPU path (PyTensor's JAX backend, "
                   "NCCL through CuPy) is tested against stand-ins but has not yet been validated "
                   "on a real GPU. Pass device='gpu' to use it knowingly (no warning), or "
                   "device='cpu' to run one process per CPU core.")


def choose(device: str, use_gpu: bool | None) -> tuple:
    """The Device class for ``fork(device=...)`` (already checked: "auto", "cpu"
    or "gpu") and how many of its units to use; ``device="gpu"`` without a
    usable GPU raises RuntimeError naming what is missing."""
    names = AUTO if device == "auto" else (device,)
    for name in names:
        units = DEVICES[name].units(required=device != "auto")
        if units:
            break
    if use_gpu and not units:
        warnings.warn(f"use_gpu=True, but {gpu_stack.no_gpu_reason() or 'no GPU can be used'}: running on "
                      "the CPU (device='gpu' makes this an error)", stacklevel=user_stacklevel())
    if device == "auto" and units and name == "gpu" and not use_gpu:
        _warn_unvalidated()
    return (DEVICES[name] if units else CpuDevice), units


def _warn_unvalidated() -> None:
    """Warn, once per process, that ``device="auto"`` picked a GPU path never run on a GPU."""
    if GPU_VALIDATED or "unvalidated GPU" in context.warned:
        return
    context.warned.add("unvalidated GPU")
    warnings.warn(UNVALIDATED_GPU, UserWarning, stacklevel=user_stacklevel())


def create(cls, units: int, n_parallel: int, master_rank: int) -> Device:
    """The master's device for a fork of ``n_parallel`` processes (warnings, plan, bind the master)."""
    return cls.create(units, n_parallel, master_rank)
