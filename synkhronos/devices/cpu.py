"""The CPU device: host memory only, every decision trivial."""

from __future__ import annotations

from .base import Device

__all__ = ["CpuDevice"]


class CpuDevice(Device):
    """Processes compute on their share of the cores; values stay in host memory."""

    name = "cpu"
