"""The CPU device: host memory only, every decision trivial."""

from __future__ import annotations

import os
import sys

from .base import Device
from .jax_state import jax_backends_up

__all__ = ["CpuDevice"]


class CpuDevice(Device):
    """Processes compute on their share of the cores; values stay in host memory."""

    name = "cpu"

    def bind(self, rank: int) -> None:
        """PyTensor's JAX mode in a worker computes on the CPU, unless the user named
        ``JAX_PLATFORMS``: on a machine with a GPU, one process per core would
        each open the GPU and take 75% of its memory (on an H100, the second
        worker failed so). The master computes wherever its JAX does."""
        if os.environ.get("JAX_PLATFORMS"):
            return
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax = sys.modules.get("jax")
        if jax is not None and not jax_backends_up():  # imported before fork: its config already read the env
            jax.config.update("jax_platforms", "cpu")
