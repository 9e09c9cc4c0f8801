"""GPU benchmark: a synk call's overhead over the plain JAX-mode PyTensor call, and NCCL all-reduce bandwidth.

Run on a machine with a GPU and the GPU stack (``pip install synkhronos[gpu]``):
``python bench/gpu_bench.py [--mib 64] [--reps 20] [--json PATH]``.
Without them it prints why and exits with status 2 (nothing is measured).

With one process on one GPU (a real one-rank NCCL communicator):

- per-call overhead: the same graph compiled in JAX mode, called through
  ``synk.function`` (inputs scattered from host memory, outputs reduced
  through NCCL and returned as numpy, or as JAX arrays with
  ``device_outputs=True``) and called plainly through ``pytensor.function``
  on the same GPU (``np.asarray`` of its outputs, or ``block_until_ready``);
- NCCL all-reduce of 64 MiB of float32 with one rank: raw CuPy NCCL
  (``allReduce`` plus a stream synchronisation), ``synk.all_reduce`` of a
  shared variable on the device (sum), and the device-to-device copy of the
  same bytes for scale. Bandwidth is bytes / time (NCCL's "algbw").

Prints a table and writes JSON under ``bench/results/`` (``gpu-<time>.json``
and ``gpu-latest.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--mib", type=int, default=64, help="all-reduce size in MiB of the headline row")
p.add_argument("--sizes", default="4,4096,262144,4194304,67108864,268435456",
               help="all-reduce sizes in bytes, comma-separated (default 4 B to 256 MiB)")
p.add_argument("--reps", type=int, default=20, help="timed repetitions of each bandwidth measurement")
p.add_argument("--calls", type=int, default=300, help="timed calls of each per-call measurement")
p.add_argument("--rows", type=int, default=256, help="rows of the per-call input")
p.add_argument("--profile", action="store_true",
               help="also print cProfile's top functions over 300 calls of synk.all_reduce (4 B) and of "
                    "a call with device_outputs=True: where synkhronos's time goes above the plain call")
p.add_argument("--json", default=None, help="where to write the results (default bench/results/gpu-<time>.json)")
args = p.parse_args()

from synkhronos import gpu  # noqa: E402  (imports neither CuPy nor JAX)
from synkhronos._integrations.jax_dtypes import typed_jax_mode  # noqa: E402

missing = gpu.stack_missing()
if missing:
    print(f"gpu_bench: the GPU stack is not installed ({' and '.join(missing)} missing): "
          "pip install synkhronos[gpu]; nothing measured")
    sys.exit(2)
if gpu.count_gpus() < 1:
    found = gpu.probe()
    print(f"gpu_bench: no GPU is visible ({found.missing or found.error or 'CuPy counts no device'}); "
          "nothing measured")
    sys.exit(2)

import synkhronos as synk  # noqa: E402

synk.fork(1, device="gpu")  # first: binds this process to GPU 0 before CUDA starts

import cupy  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from synkhronos import _runtime as runtime  # noqa: E402

proc = runtime.running_session().proc
assert proc.device.comm is not None, "one process on one GPU should hold a one-rank NCCL communicator"


def timed(fn, n, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times),
            "p25_s": statistics.quantiles(times, n=4)[0], "p75_s": statistics.quantiles(times, n=4)[2],
            "n": n}


# -- per-call overhead --------------------------------------------------------

rng = np.random.default_rng(0)
x = pt.matrix("x", dtype="float32")
w = pytensor.shared(rng.standard_normal((64, 64)).astype(np.float32), name="w")
h = pt.tanh(pt.dot(x, w))
outputs = [pt.mean(h, axis=0), pt.sum(h ** 2)]
f = synk.function([x], outputs)  # mode="JAX" by default on the GPU device, avg reduced by NCCL
# compiled as synk.function compiles JAX mode (the graph's float32; PyTensor's own JAX mode
# returns these float32 reductions as float64): the difference is synkhronos's own
plain = pytensor.function([x], outputs, mode=typed_jax_mode("JAX"))
data = rng.standard_normal((args.rows, 64)).astype(np.float32)
np.testing.assert_allclose(f(data)[0], np.asarray(plain(data)[0]), rtol=1e-4, atol=1e-5)

per_call = {
    "synk, numpy outputs": timed(lambda: f(data), args.calls),
    "plain JAX-mode call + np.asarray": timed(lambda: [np.asarray(o) for o in plain(data)], args.calls),
    "synk, device_outputs=True": timed(lambda: jax.block_until_ready(f(data, device_outputs=True)),
                                       args.calls),
    "plain JAX-mode call + block_until_ready": timed(lambda: jax.block_until_ready(plain(data)), args.calls),
}
overhead = {
    "numpy outputs": per_call["synk, numpy outputs"]["median_s"]
    - per_call["plain JAX-mode call + np.asarray"]["median_s"],
    "device outputs": per_call["synk, device_outputs=True"]["median_s"]
    - per_call["plain JAX-mode call + block_until_ready"]["median_s"],
}

# -- NCCL all-reduce, 1 rank, 4 B to 256 MiB -------------------------------------

comm = proc.device.comm._comm
stream = cupy.cuda.Stream(non_blocking=True)
f32, nsum = cupy.cuda.nccl.NCCL_FLOAT32, cupy.cuda.nccl.NCCL_SUM
sizes = sorted({int(b) for b in args.sizes.split(",")} | {args.mib << 20})
bigs = {b: pytensor.shared(np.ones(max(b // 4, 1), dtype=np.float32), name=f"big{b}") for b in sizes}
synk.function([], [pt.sum(v) for v in bigs.values()])
synk.distribute()
assert all(bool(np.all(gpu.on_device(v))) for v in bigs.values()), "shared variables should live on the device"
sweep = {}
SYNK_AR = "synk.all_reduce(shared, 'sum')"
for nbytes in sizes:
    count = max(nbytes // 4, 1)
    with stream:
        src = cupy.random.standard_normal(count, dtype=cupy.float32)
        dst = cupy.empty_like(src)
    stream.synchronize()

    def raw_all_reduce():
        comm.allReduce(src.data.ptr, dst.data.ptr, count, f32, nsum, stream.ptr)
        stream.synchronize()

    def d2d_copy():
        with stream:
            cupy.copyto(dst, src)
        stream.synchronize()

    reps = args.reps if nbytes >= 1 << 24 else max(args.reps, 200)
    row = {}
    for label, fn in (("raw CuPy NCCL allReduce", raw_all_reduce),
                      (SYNK_AR, lambda: synk.all_reduce(bigs[nbytes], "sum")),
                      ("device-to-device copy (scale)", d2d_copy)):
        t = timed(fn, reps, warmup=3)
        t["GB_per_s"] = count * 4 / t["median_s"] / 1e9
        row[label] = t
    row["synk / raw"] = row[SYNK_AR]["median_s"] / row["raw CuPy NCCL allReduce"]["median_s"]
    sweep[count * 4] = row
    np.testing.assert_allclose(np.asarray(bigs[nbytes].get_value(borrow=True))[:4], 1.0)  # sum over one rank
    del src, dst
nbytes = args.mib << 20
bandwidth = sweep[nbytes]

result = {
    "when": datetime.datetime.now().isoformat(timespec="seconds"),
    "host": platform.node(),
    "device": proc.device.state.describe(),
    "gpu_name": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    "versions": {"jax": jax.__version__, "cupy": cupy.__version__, "pytensor": pytensor.__version__,
                 "nccl": cupy.cuda.nccl.get_version(), "python": platform.python_version()},
    "per_call": per_call,
    "per_call_overhead_s": overhead,
    "rows": args.rows,
    "all_reduce_bytes": nbytes,
    "all_reduce_ranks": 1,
    "all_reduce": bandwidth,
    "all_reduce_sweep": {str(k): v for k, v in sweep.items()},
}
synk.close()

print(f"GPU: {result['gpu_name']} ({result['device']}); jax {jax.__version__}, cupy {cupy.__version__}, "
      f"NCCL {result['versions']['nccl']}")
print(f"\nper call, {args.rows}x64 float32 input, 2 outputs (median of {args.calls})")
print(f"{'':45s} {'median':>10s} {'p25':>10s} {'p75':>10s}")
for label, t in per_call.items():
    print(f"{label:45s} {t['median_s'] * 1e6:8.1f}us {t['p25_s'] * 1e6:8.1f}us {t['p75_s'] * 1e6:8.1f}us")
for label, dt in overhead.items():
    print(f"{'overhead, ' + label:45s} {dt * 1e6:8.1f}us")
print(f"\nall-reduce of {args.mib} MiB float32, 1 rank (median of {args.reps})")
print(f"{'':45s} {'median':>10s} {'GB/s':>10s}")
for label, t in bandwidth.items():
    if isinstance(t, dict):
        print(f"{label:45s} {t['median_s'] * 1e3:8.3f}ms {t['GB_per_s']:10.1f}")
print("\nall-reduce sweep, 1 rank (medians): bytes, raw NCCL, synk.all_reduce, ratio, d2d copy")
for b, row in sweep.items():
    print(f"{b:>12d} {row['raw CuPy NCCL allReduce']['median_s'] * 1e6:10.1f}us "
          f"{row[SYNK_AR]['median_s'] * 1e6:10.1f}us {row['synk / raw']:6.2f} "
          f"{row['device-to-device copy (scale)']['median_s'] * 1e6:10.1f}us")

if args.profile:
    import cProfile
    import pstats

    synk.fork(1, device="gpu")  # again, for the profiles (CUDA is up: one process on the same GPU)
    tiny = pytensor.shared(np.ones(1, dtype=np.float32), name="tiny")
    f = synk.function([x], outputs)
    synk.function([], pt.sum(tiny))
    synk.distribute()
    for label, fn in (("synk.all_reduce, 4 B", lambda: synk.all_reduce(tiny, "sum")),
                      ("synk call, device_outputs=True",
                       lambda: jax.block_until_ready(f(data, device_outputs=True)))):
        for _ in range(20):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        print(f"\n--- profile: {label}, 300 calls (cumulative, then own time) ---")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    synk.close()

RESULTS.mkdir(parents=True, exist_ok=True)
out = Path(args.json) if args.json else RESULTS / f"gpu-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2))
(RESULTS / "gpu-latest.json").write_text(json.dumps(result, indent=2))
print(f"\nwrote {out}")
