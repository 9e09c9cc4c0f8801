"""all_reduce of a 64 MiB float32 shared variable with 2 processes, against a numpy copy.

Run: ``.venv/bin/python bench/all_reduce.py [--mib 64] [--n 2] [--reps 10] [--op avg]``.
Prints the median of each and their ratio, and writes ``bench/results/all_reduce.json``.
The copy (``np.copyto`` of the same array) is the floor: an all-reduce must at
least read every process's copy and write the result into every process's copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import synkhronos as synk

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--mib", type=int, default=64, help="size of the variable in MiB")
p.add_argument("--n", type=int, default=2, help="processes, master included")
p.add_argument("--reps", type=int, default=10, help="timed repetitions (after warm-up)")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--op", default="avg", choices=("avg", "sum", "prod", "max", "min"))
p.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "all_reduce.json"))
args = p.parse_args()

synk.fork(args.n, device="cpu")

import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

count = (args.mib << 20) // 4
rng = np.random.default_rng(0)
value = rng.standard_normal(count, dtype=np.float32)
var = pytensor.shared(value.copy(), name="w")
synk.function([], pt.sum(var), mode="FAST_COMPILE")
synk.distribute()
for rank in range(args.n):
    synk.set_value(rank, var, value * (rank + 1))


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def check_result():
    """After all_reduce every process holds the same array."""
    first = synk.get_value(0, var)
    return all(np.array_equal(first, synk.get_value(r, var)) for r in range(1, args.n))


dst = np.empty_like(value)
load_before = os.getloadavg()
reduce_times = timed(lambda: synk.all_reduce(var, op=args.op), args.reps, args.warmup)
same = check_result()
copy_times = timed(lambda: np.copyto(dst, value), args.reps, args.warmup)
load_after = os.getloadavg()
synk.close()

red, cop = statistics.median(reduce_times), statistics.median(copy_times)
gib = (count * 4) / (1 << 30)
print(f"all_reduce(op={args.op!r}) of {args.mib} MiB float32, {args.n} processes: "
      f"median {red * 1e3:.2f} ms over {args.reps} reps ({gib / red:.2f} GiB/s of the variable)")
print(f"np.copyto of the same array: median {cop * 1e3:.2f} ms ({gib / cop:.2f} GiB/s)")
print(f"ratio all_reduce / copy: {red / cop:.2f}")
print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")

result = {
    "benchmark": "all_reduce_vs_copy",
    "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
    "cpus": len(os.sched_getaffinity(0)), "n_parallel": args.n, "op": args.op,
    "bytes": count * 4, "dtype": "float32", "reps": args.reps, "warmup": args.warmup,
    "all_reduce_s": {"median": red, "min": min(reduce_times), "max": max(reduce_times),
                     "all": reduce_times},
    "copy_s": {"median": cop, "min": min(copy_times), "max": max(copy_times), "all": copy_times},
    "ratio": red / cop, "every_rank_equal": same,
    "loadavg_before": load_before, "loadavg_after": load_after,
}
out = Path(args.json)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=1) + "\n")
print(f"wrote {out}")
