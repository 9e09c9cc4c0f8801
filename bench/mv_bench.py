"""Parameter-server tables: async ``add`` and ``get`` of a 1M-float table against their floors.

    python bench/mv_bench.py [--workers 2] [--size 1000000] [--reps 50]
    mpirun -np 2 python bench/mv_bench.py

Forked (no launcher): both workers add and get at the same time; the floor
is a plain numpy add (``a += b``) and copy of the same size in one process.
Under mpirun: the table is split across the ranks in MPI windows; the floor
is raw mpi4py ``Accumulate`` / ``Get`` on a window of the same layout (each
rank owns half, every call locks each owner in turn). Worker 0 prints one
table of median times per call (milliseconds) and GB/s of table data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import synkhronos.multiverso as mv  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def raw_mpi(size: int, reps: int):
    """Raw mpi4py Accumulate / Get on a window split like a table (the MPI floor)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    bounds = [(size * r // n, size * (r + 1) // n) for r in range(n)]
    a, b = bounds[me]
    win = MPI.Win.Allocate(4 * (b - a), disp_unit=1, comm=comm)
    data = np.ones(size, dtype=np.float32)
    out = np.empty(size, dtype=np.float32)

    def add():
        for r in range(n):
            lo, hi = bounds[r]
            win.Lock(r, MPI.LOCK_SHARED)
            win.Accumulate([data[lo:hi], MPI.FLOAT], r, target=(0, hi - lo, MPI.FLOAT), op=MPI.SUM)
            win.Unlock(r)

    def get():
        for r in range(n):
            lo, hi = bounds[r]
            win.Lock(r, MPI.LOCK_SHARED)
            win.Get([out[lo:hi], MPI.FLOAT], r, target=(0, hi - lo, MPI.FLOAT))
            win.Unlock(r)

    comm.Barrier()
    t_add = timed(add, reps)
    comm.Barrier()
    t_get = timed(get, reps)
    comm.Barrier()
    win.Free()
    return t_add, t_get


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="workers to fork (ignored under mpirun)")
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=50)
    args, _ = ap.parse_known_args()
    launched = mv.under_launcher()
    mv.init(num_workers=None if launched else args.workers)
    n, me = mv.workers_num(), mv.worker_id()
    size, reps = args.size, args.reps

    table = mv.ArrayTableHandler(size)
    data = np.ones(size, dtype=np.float32)
    out = np.empty(size, dtype=np.float32)
    mv.barrier()
    t_add = timed(lambda: table.add(data), reps)
    mv.barrier()
    t_get = timed(lambda: table.get(out=out), reps)
    mv.barrier()
    t_get_new = timed(table.get, reps)
    mv.barrier()

    rows = [("mv add (async, every worker at once)", t_add),
            ("mv get(out=)", t_get),
            ("mv get() (new array)", t_get_new)]
    if launched:
        r_add, r_get = raw_mpi(size, reps)
        rows += [("raw mpi4py Accumulate (lock, SUM, unlock per owner)", r_add),
                 ("raw mpi4py Get (lock, get, unlock per owner)", r_get)]
    elif me == 0:
        a = np.zeros(size, dtype=np.float32)
        rows += [("numpy a += b (one process)", timed(lambda: np.add(a, data, out=a), reps)),
                 ("numpy copy (one process)", timed(lambda: np.copyto(out, a), reps))]
    mv.barrier()
    if me == 0:
        where = f"mpirun -np {n}" if launched else f"{n} forked workers"
        print(f"table of {size:,} float32 ({size * 4 / 2**20:.1f} MiB), {where}, median of {reps}")
        print(f"{'operation':<55} {'ms':>8} {'GB/s':>8}")
        for name, t in rows:
            print(f"{name:<55} {t * 1e3:8.3f} {size * 4 / t / 1e9:8.2f}")
    mv.shutdown()


if __name__ == "__main__":
    main()
