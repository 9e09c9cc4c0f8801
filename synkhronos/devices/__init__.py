"""Devices: what a fork computes on, and the one place fork() chooses it."""

from __future__ import annotations

import warnings

from .. import _state as state
from ..errors import user_stacklevel
from . import gpu_stack
from .base import Device
from .cpu import CpuDevice
from .gpu import GpuDevice

__all__ = ["Device", "CpuDevice", "GpuDevice", "DEVICES", "choose", "create"]

#: ``fork(device=...)`` name -> Device class.
DEVICES: dict[str, type[Device]] = {"cpu": CpuDevice, "gpu": GpuDevice}
#: What ``device="auto"`` tries, in order: the first with units to use, else the last.
AUTO = ("gpu", "cpu")
#: The most GPUs the GPU path has run on (docs/gpu-validation.rst: one H100, 2026-11-26, NCCL
#: with one rank): ``device="auto"`` warns (once per process) when it picks more than this.
VALIDATED_GPUS = 1


def unvalidated_gpus(units: int) -> str:
    """The warning of ``device="auto"`` picking ``units`` GPUs, more than have been validated."""
    return (f"device='auto' chose {units} GPUs: synkhronos's GPU path has run on one GPU "
            "(docs/gpu-validation.rst), but NCCL across several GPUs has not yet been validated on "
            "real GPUs. Pass device='gpu' to use it knowingly (no warning), or device='cpu' to run "
            "one process per CPU core.")


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
        _warn_unvalidated(units)
    return (DEVICES[name] if units else CpuDevice), units


def _warn_unvalidated(units: int) -> None:
    """Warn, once per process, that ``device="auto"`` picked more GPUs than the path has run on."""
    if units <= VALIDATED_GPUS or "unvalidated GPU" in state.warned:
        return
    state.warned.add("unvalidated GPU")
    warnings.warn(unvalidated_gpus(units), UserWarning, stacklevel=user_stacklevel())


def create(cls: type[Device], units: int, n_parallel: int, master_rank: int) -> Device:
    """The master's device for a fork of ``n_parallel`` processes (warnings, plan, bind the master)."""
    return cls.create(units, n_parallel, master_rank)
