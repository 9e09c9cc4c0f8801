"""The device count of the CPU stand-in for CuPy: FAKE_CUPY_GPUS (default 1)."""

import os


def getDeviceCount() -> int:
    return int(os.environ.get("FAKE_CUPY_GPUS", "1"))


def getDeviceProperties(index: int) -> dict:
    return {"name": b"fake GPU (numpy on the CPU)"}
