"""Stand-in GPU benchmark: gpu_bench.py's small rows on the CuPy stand-in, without a GPU.

    python bench/fakegpu_bench.py [--quick] [--rounds 5] [--reps 300] [--json PATH] [--profile]

One process: ``synk.fork(1, device="gpu")`` with tests/fakegpu's CuPy (its
NCCL has one rank here) and JAX on the CPU (one thread), installed as
tests/gpu_scenarios.py ``--fake`` installs them (tests/fakegpu/install.py).
It times what bench/gpu_bench.py times on a GPU, where the GPU's own work
costs nothing and synkhronos's Python is all that is left:

- "stand-in allReduce 4 B": the raw stand-in NCCL ``allReduce`` of one
  float32 plus a stream synchronisation (gpu_bench's "raw CuPy NCCL");
- "synk.all_reduce 4 B": ``synk.all_reduce`` (sum) of a one-float32 shared
  variable on the device;
- per call, gpu_bench's graph (``tanh(x @ w)``, two outputs reduced by avg
  and sum): the plain JAX-mode PyTensor call (``+ np.asarray`` of its
  outputs, ``+ block_until_ready``), the ``synk.function`` call with numpy
  outputs and with ``device_outputs=True``.

Each row is the best of ``--rounds`` rounds (interleaved: round 1 of every
row, then round 2, ...) of ``--reps`` calls each, the time per call. The
target is issue 48's: ``synk.all_reduce`` 4 B within 2x the stand-in's
``allReduce``. Prints a table (MET / NOT MET) and writes JSON: to ``--json``,
or to ``bench/results/fakegpu-<time>.json`` and ``fakegpu-latest.json``.
It proves nothing about a GPU's time (gpu_bench.py on a GPU does); it shows
synkhronos's own time on the GPU path, which the GPU cannot hide.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
import report  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--quick", action="store_true", help="2 rounds of 50 calls: a smoke run")
p.add_argument("--rounds", type=int, default=None, help="rounds per row; the best counts (default 5)")
p.add_argument("--reps", type=int, default=None, help="calls per round (default 300)")
p.add_argument("--rows", type=int, default=256, help="rows of the per-call input (as gpu_bench.py)")
p.add_argument("--profile", action="store_true",
               help="also print cProfile's top functions over 300 calls of synk.all_reduce (4 B) and of "
                    "each synk call row")
p.add_argument("--json", default=None, help="where to write the results (default "
                                            "bench/results/fakegpu-<time>.json and fakegpu-latest.json)")
args = p.parse_args()
rounds = args.rounds or (2 if args.quick else 5)
reps = args.reps or (50 if args.quick else 300)

if importlib.util.find_spec("jax") is None:
    print("fakegpu_bench: needs jax (a CPU build is enough: pip install jax); nothing measured")
    sys.exit(2)

# JAX's CPU work on one thread, as in a worker of one core (before JAX is imported)
from synkhronos._procs.xla_flags import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), 1)

_spec = importlib.util.spec_from_file_location("_fakegpu_install", ROOT / "tests" / "fakegpu" / "install.py")
assert _spec is not None and _spec.loader is not None
_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_install)
_install.install()  # the CuPy stand-in first on sys.path, JAX on the CPU device

import synkhronos as synk  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    synk.fork(1, device="gpu")

import cupy  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from synkhronos import gpu, _runtime as runtime  # noqa: E402
from synkhronos._integrations.jax_dtypes import typed_jax_mode  # noqa: E402

assert getattr(cupy, "FAKE", False), "a real CuPy was imported instead of the stand-in"
proc = runtime.running_session().proc
assert proc.device.name == "gpu" and proc.device.comm is not None, \
    "one process on the stand-in GPU should hold a one-rank NCCL communicator"

# -- the rows ----------------------------------------------------------------

RAW, SYNK_AR = "stand-in allReduce 4 B", "synk.all_reduce 4 B"
PLAIN_NP, PLAIN_BR = "plain JAX-mode call + np.asarray", "plain JAX-mode call + block_until_ready"
SYNK_NP, SYNK_DEV = "synk call, numpy outputs", "synk call, device_outputs=True"

comm = proc.device.comm._comm
stream = cupy.cuda.Stream(non_blocking=True)
f32, nsum = cupy.cuda.nccl.NCCL_FLOAT32, cupy.cuda.nccl.NCCL_SUM
with stream:
    src = cupy.random.standard_normal(1, dtype=cupy.float32)
    dst = cupy.empty_like(src)
stream.synchronize()


def raw_all_reduce():
    comm.allReduce(src.data.ptr, dst.data.ptr, 1, f32, nsum, stream.ptr)
    stream.synchronize()


tiny = pytensor.shared(np.ones(1, dtype=np.float32), name="tiny")
rng = np.random.default_rng(0)
x = pt.matrix("x", dtype="float32")
w = pytensor.shared(rng.standard_normal((64, 64)).astype(np.float32), name="w")
h = pt.tanh(pt.dot(x, w))
outputs = [pt.mean(h, axis=0), pt.sum(h ** 2)]
f = synk.function([x], outputs)  # mode="JAX" by default on the GPU device, avg/sum reduced by NCCL
synk.function([], pt.sum(tiny))
plain = pytensor.function([x], outputs, mode=typed_jax_mode("JAX"))
synk.distribute()
assert bool(np.all(gpu.on_device(tiny))), "the shared variable should live on the (stand-in) device"
data = rng.standard_normal((args.rows, 64)).astype(np.float32)
np.testing.assert_allclose(f(data)[0], np.asarray(plain(data)[0]), rtol=1e-4, atol=1e-5)

ROWS = {
    RAW: raw_all_reduce,
    SYNK_AR: lambda: synk.all_reduce(tiny, "sum"),
    PLAIN_NP: lambda: [np.asarray(o) for o in plain(data)],
    PLAIN_BR: lambda: jax.block_until_ready(plain(data)),
    SYNK_NP: lambda: f(data),
    SYNK_DEV: lambda: jax.block_until_ready(f(data, device_outputs=True)),
}


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


for fn in ROWS.values():  # warm-up
    per_call(fn, 20)
times: dict = {label: [] for label in ROWS}
with bl.ForeignLoad() as load:
    for _ in range(rounds):
        for label, fn in ROWS.items():
            times[label].append(per_call(fn, reps))
np.testing.assert_allclose(np.asarray(tiny.get_value(borrow=True)), 1.0)  # a sum over one rank
# which route the all_reduce row took: the communicator's kept plan (NCCL in place), or the full path
kept = [p for p in runtime.running_session().kept.plans.values() if hasattr(p, "cplan")]
all_reduce_route = type(kept[0].cplan).__name__ if kept else "full path (no kept plan)"

rows = {label: {"best_s": min(t), "rounds_s": t, "reps": reps} for label, t in times.items()}
ratio = rows[SYNK_AR]["best_s"] / rows[RAW]["best_s"]
result = {
    "when": datetime.datetime.now().isoformat(timespec="seconds"),
    "host": platform.node(),
    "cpu": bl.cpu_model(),
    "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "loadavg": os.getloadavg(),
    "foreign_cpu_share_measuring": load.share,
    "quick": args.quick,
    "device": proc.device.state.describe(),
    "synkhronos": str(Path(synk.__file__).resolve().parent),  # which checkout was measured
    "versions": {"jax": jax.__version__, "cupy": cupy.__version__, "pytensor": pytensor.__version__,
                 "numpy": np.__version__, "python": platform.python_version()},
    "per_call_rows": args.rows,
    "rounds": rounds,
    "reps": reps,
    "rows": rows,
    "overhead_s": {"numpy outputs": rows[SYNK_NP]["best_s"] - rows[PLAIN_NP]["best_s"],
                   "device outputs": rows[SYNK_DEV]["best_s"] - rows[PLAIN_BR]["best_s"]},
    "all_reduce_ratio": ratio,
    "all_reduce_route": all_reduce_route,
    "target": {"target": "stand-in: synk.all_reduce 4 B ≤ 2× the stand-in's allReduce (issue 48)",
               "ratio": ratio, "limit": 2.0, "status": "MET" if ratio <= 2.0 else "NOT MET"},
}

if args.profile:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        synk.all_reduce(tiny, "sum")
    prof.disable()
    print("--- profile: synk.all_reduce 4 B on the stand-in, 300 calls (cumulative, then own time) ---")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    for label in (SYNK_NP, SYNK_DEV):
        prof = cProfile.Profile()
        prof.enable()
        per_call(ROWS[label], 300)
        prof.disable()
        print(f"--- profile: {label}, 300 calls (cumulative, then own time) ---")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
synk.close()

print("\n".join(report.fakegpu_lines(result)))
if args.json:
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    bl.write_part(str(out), result)
else:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"fakegpu-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    bl.write_part(str(out), result)
    bl.write_part(str(RESULTS / "fakegpu-latest.json"), result)
print(f"\nwrote {out}")
