"""The public GPU names: how many GPUs, whether the GPU stack is there, where
shared variables live, and the array conversions.

The GPU device itself is :mod:`synkhronos.devices.gpu`; finding the stack and
binding processes to GPUs is :mod:`synkhronos.devices.gpu_stack`. Nothing
here imports CuPy or JAX at synkhronos import time.
"""

from __future__ import annotations

from ._arrays import to_cupy, to_jax, to_numpy
from .devices.gpu_stack import count_gpus, get_n_gpu, gpu_available, probe, stack_missing
from ._shareds.api import on_device

__all__ = ["stack_missing", "probe", "count_gpus", "gpu_available", "get_n_gpu", "on_device", "to_numpy",
           "to_cupy", "to_jax"]
