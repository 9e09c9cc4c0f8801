"""Soak: many small calls and collectives; memory, descriptors and segments stay flat.

    .venv/bin/python bench/soak.py [--calls 100000] [--collectives 1000] [-n 2]
                                   [--data-loops 2000] [--fork-cycles 200]

Samples, for the master and every worker, the resident memory (VmRSS), the
number of open file descriptors and memory maps, and the number of
shared-memory entries of this fork, and fails (exit 1) if any of them grows
beyond a small tolerance between the first and the last sample. Then it
creates and drops ``synk.data`` objects in a loop (each used by a call), and
runs ``fork()``/``close()`` cycles: the bytes of this fork's segments in
/dev/shm, the shared-memory mappings and the descriptors must stay flat.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos import _runtime as runtime


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _count(path):
    try:
        return len(os.listdir(path))
    except OSError:
        return -1


def _maps(pid):
    with open(f"/proc/{pid}/maps") as fh:
        return sum(1 for _ in fh)


def _shm_bytes(tag):
    total = 0
    for e in os.listdir("/dev/shm"):
        if tag in e:
            try:
                total += os.stat(os.path.join("/dev/shm", e)).st_size
            except FileNotFoundError:
                pass
    return total


def _shm_maps(pid):
    with open(f"/proc/{pid}/maps") as fh:
        return sum(1 for line in fh if "/dev/shm/synk." in line)


def data_loop(loops, n):
    """Create a 1 MiB synk.data, use it in a call, drop it; /dev/shm and descriptors stay flat."""
    synk.fork(n)
    prefix = runtime.running_session().proc.prefix
    x = pt.dvector("x")
    f = synk.function([x], x.sum())
    pids = [os.getpid()] + list(runtime.running_session().watch.pids.values())
    rows = []
    for i in range(loops + 1):
        d = synk.data(np.ones(2**17))
        f(d)
        del d
        if i % max(1, loops // 10) == 0:
            rows.append({"loop": i, "shm_bytes": _shm_bytes(prefix),
                         "fds": [_count(f"/proc/{p}/fd") for p in pids],
                         "shm_maps": [_shm_maps(p) for p in pids]})
    synk.close()
    return rows


def fork_cycles(cycles, n):
    """fork(), a call, a collective and a synk.data, close(): nothing accumulates in the master."""
    tag = f"synk.{os.getpid()}."
    x = pt.dvector("x")
    rows = []
    for i in range(cycles + 1):
        synk.fork(n)
        s = pytensor.shared(np.ones(1000), name="s")
        f = synk.function([x], (x * s[: x.shape[0]]).sum())
        d = synk.data(np.ones(100))
        f(d)
        synk.all_reduce(s)
        synk.close()
        del f, d, s
        if i % max(1, cycles // 10) == 0:
            rows.append({"cycle": i, "fds": _count(f"/proc/{os.getpid()}/fd"),
                         "shm_maps": _shm_maps(os.getpid()), "shm_bytes": _shm_bytes(tag)})
    return rows


def sample(prefix):
    pids = [os.getpid()] + list(runtime.running_session().watch.pids.values())
    return {
        "rss_kib": [_rss_kib(p) for p in pids],
        "fds": [_count(f"/proc/{p}/fd") for p in pids],
        "maps": [_maps(p) for p in pids],
        "shm": sum(1 for e in os.listdir("/dev/shm") if prefix in e),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--collectives", type=int, default=1_000)
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--data-loops", type=int, default=2000)
    ap.add_argument("--fork-cycles", type=int, default=200)
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args()

    synk.fork(args.n)
    prefix = runtime.running_session().proc.prefix
    x = pt.dvector("x")
    s = pytensor.shared(np.ones(1000), name="s")
    f = synk.function([x], [x.sum(), (x * s[: x.shape[0]]).max()], updates=[(s, s * 1.0)])
    g = synk.function([x], (x, "gather"))
    synk.distribute()
    data = synk.data(np.arange(64.0))
    arr = np.arange(64.0)

    # warm up every kind of call (allocators, caches, scratch segments at full size)
    for i in range(2000):
        f(arr)
        f(data, batch=slice(0, 32))
        g(arr[: 1 + i % 64])
    synk.all_reduce(s), synk.broadcast(s), synk.gather(s)
    samples = [(0, sample(prefix))]
    t0 = time.perf_counter()
    step = max(1, args.calls // 10)
    for i in range(1, args.calls + 1):
        if i % 3 == 0:
            f(data, batch=slice(0, 32))
        elif i % 3 == 1:
            f(arr)
        else:
            g(arr[: 1 + i % 64])
        if i % step == 0:
            samples.append((i, sample(prefix)))
    t_calls = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.collectives):
        op = ("avg", "sum", "max", "min")[i % 4]
        synk.all_reduce(s, op=op)
        if i % 4 == 0:
            synk.broadcast(s)
            synk.gather(s)
    t_coll = time.perf_counter() - t0
    samples.append(("end", sample(prefix)))
    synk.close()

    first, last = samples[0][1], samples[-1][1]
    growth = {
        "rss_kib": [b - a for a, b in zip(first["rss_kib"], last["rss_kib"])],
        "fds": [b - a for a, b in zip(first["fds"], last["fds"])],
        "maps": [b - a for a, b in zip(first["maps"], last["maps"])],
        "shm": last["shm"] - first["shm"],
    }
    ok = (max(growth["rss_kib"]) < 8 * 1024 and max(growth["fds"]) <= 0
          and max(growth["maps"]) <= 2 and growth["shm"] <= 0)
    data_rows = data_loop(args.data_loops, args.n) if args.data_loops else []
    cycle_rows = fork_cycles(args.fork_cycles, args.n) if args.fork_cycles else []
    flat_data = all(r["shm_bytes"] == data_rows[0]["shm_bytes"]
                    and all(a <= b for a, b in zip(r["fds"], data_rows[0]["fds"]))
                    and all(a <= b for a, b in zip(r["shm_maps"], data_rows[0]["shm_maps"]))
                    for r in data_rows)
    flat_cycles = all(r["fds"] <= cycle_rows[0]["fds"] and r["shm_maps"] == 0 and r["shm_bytes"] == 0
                      for r in cycle_rows)
    ok = ok and flat_data and flat_cycles
    result = {"calls": args.calls, "collectives": args.collectives, "n": args.n,
              "seconds_calls": t_calls, "us_per_call": 1e6 * t_calls / args.calls,
              "seconds_collectives": t_coll, "samples": samples, "growth": growth,
              "data_loop": data_rows, "flat_data_loop": flat_data,
              "fork_cycles": cycle_rows, "flat_fork_cycles": flat_cycles, "flat": ok}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(f"{args.calls} calls in {t_calls:.1f} s ({result['us_per_call']:.1f} us/call), "
          f"{args.collectives} collective rounds in {t_coll:.1f} s")
    print("first sample:", first)
    print("last sample: ", last)
    print("growth:      ", growth)
    for r in data_rows:
        print("data loop   ", r)
    for r in cycle_rows:
        print("fork cycles ", r)
    print("FLAT" if ok else "GROWTH DETECTED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
