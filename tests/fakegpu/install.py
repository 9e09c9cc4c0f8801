"""Make this process (and the processes it starts) use the CuPy stand-in and JAX on the CPU.

``install()`` is what ``tests/gpu_scenarios.py --fake`` and ``bench/fakegpu_bench.py``
do before ``synk.fork(..., device="gpu")``: this folder goes first on ``sys.path``
and ``PYTHONPATH`` (so ``import cupy`` finds the stand-in, here and in workers),
JAX runs on its CPU device, and the GPU device's state takes JAX's CPU device
where it would take a GPU. Import it by path (``tests/`` on ``sys.path``:
``from fakegpu.install import install``); it proves the wiring, not CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

__all__ = ["install"]


def install() -> None:
    """CuPy stand-in and JAX on the CPU, as the GPU device of every process of the fork."""
    fake = str(HERE)
    sys.path.insert(0, fake)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [fake] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from synkhronos.devices import gpu as gpu_device

    def fake_state(self):
        import cupy
        import jax

        assert getattr(cupy, "FAKE", False)
        self.jax_device = jax.devices("cpu")[0]
        self.cupy_device = cupy.cuda.Device(0)
        self.cupy_device.use()
        self.placed = {}

    gpu_device.GpuState.__init__ = fake_state
