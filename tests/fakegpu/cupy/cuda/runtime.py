"""The device count of the CPU stand-in for CuPy: FAKE_CUPY_GPUS (default 1)."""

import os


def getDeviceCount() -> int:
    return int(os.environ.get("FAKE_CUPY_GPUS", "1"))


def getDeviceProperties(index: int) -> dict:
    return {"name": b"fake GPU (numpy on the CPU)"}


#: how many times deviceSynchronize was called, for tests to look at
synchronized = [0]


def deviceSynchronize() -> None:
    """Every stream of the device done: the stand-in's work is done when enqueued."""
    synchronized[0] += 1
