"""all_reduce of 64 MiB across nodes: synkhronos's hierarchical path against flat MPI.

    python bench/nodes_bench.py [--quick] [--results DIR]

Launches, on this machine, four ``mpirun -np N`` jobs of this same script:

  synk 2x1   2 nodes (copies of the script), each forking 1 process:
             ``synk.all_reduce(w, "sum")`` of a 64 MiB float32 shared variable;
  synk 2x2   2 nodes, each forking 2 processes (4 in all);
  mpi 2      plain mpi4py ``Allreduce`` (SUM, 64 MiB float32) on 2 ranks;
  mpi 4      the same on 4 ranks.

All jobs use Open MPI's default transports between the ranks (shared memory
here, since every "node" is this machine) and ``--bind-to none``. Before each
repetition the node masters (or ranks) line up on an MPI barrier; a
repetition's time is the slowest one's. Prints the table and the issue's
targets (hierarchical 2x1 within 1.2x of flat MPI on 2 ranks; 2x2 faster
than flat MPI on 4 ranks), writes ``DIR/nodes.json`` and ``DIR/nodes.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

HERE = Path(__file__).resolve().parent
MPIRUN = Path(sys.executable).parent / "mpirun"
NBYTES = 64 << 20
JOBS = (("synk 2x1", 2, ["synk", "1"]), ("synk 2x2", 2, ["synk", "2"]),
        ("mpi 2", 2, ["mpi", "0"]), ("mpi 4", 4, ["mpi", "0"]))


def job(kind: str, procs: int, reps: int, out: str) -> None:
    """One rank of one job: time ``reps`` all-reduces, rank 0 writes the JSON."""
    import numpy as np

    if kind == "synk":
        import pytensor

        import synkhronos as synk

        synk.fork(procs, device="cpu")
        from mpi4py import MPI  # initialised by synk.fork, after its workers were forked

        w = pytensor.shared(np.ones(NBYTES // 4, dtype=np.float32), name="w")
        synk.function([], w.sum(), mode="FAST_COMPILE")
        synk.distribute()
        times = bl.mpi_slowest(MPI.COMM_WORLD, lambda: synk.all_reduce(w, "sum"), reps)
        world = synk.world()
        info = {"nodes": world.nodes, "processes": world.size}
        synk.close()
    else:
        from mpi4py import MPI

        send = np.ones(NBYTES // 4, dtype=np.float32)
        recv = np.empty_like(send)
        times = bl.mpi_slowest(MPI.COMM_WORLD, lambda: MPI.COMM_WORLD.Allreduce(send, recv, op=MPI.SUM), reps)
        info = {"nodes": MPI.COMM_WORLD.Get_size(), "processes": MPI.COMM_WORLD.Get_size()}
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "median": float(np.median(times)), **info}))


def launch(results: Path, reps: int) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    got = {}
    for name, n, args in JOBS:
        out = results / f"nodes.{name.replace(' ', '_')}.json"
        out.unlink(missing_ok=True)
        cmd = [str(MPIRUN), "-np", str(n), "--oversubscribe", "--bind-to", "none", "--mca", "osc", "^ucx",
               sys.executable, str(Path(__file__).resolve()), "--job", *args, str(reps), str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0 or not out.exists():
            print(f"{name}: failed (rc {done.returncode})\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            continue
        got[name] = json.loads(out.read_text())
        out.unlink()
        print(f"{name:9s} median {got[name]['median'] * 1e3:8.2f} ms over {reps} repetitions", flush=True)
    return got


def targets(got: dict) -> list:
    rows = []
    for synk_job, mpi_job, limit, what in (("synk 2x1", "mpi 2", 1.2, "within 1.2x of flat MPI"),
                                           ("synk 2x2", "mpi 4", 1.0, "faster than flat MPI")):
        if synk_job in got and mpi_job in got:
            ratio = got[synk_job]["median"] / got[mpi_job]["median"]
            met = ratio <= limit if limit != 1.0 else ratio < 1.0
            rows.append({"name": f"{synk_job} vs {mpi_job}: {what}", "ratio": ratio, "met": met})
    return rows


def plot(got: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = [n for n, _, _ in JOBS if n in got]
    meds = [got[n]["median"] * 1e3 for n in names]
    colors = ["tab:blue" if n.startswith("synk") else "tab:gray" for n in names]
    ax.bar(names, meds, color=colors)
    for i, m in enumerate(meds):
        ax.text(i, m, f"{m:.1f}", ha="center", va="bottom")
    ax.set(ylabel="ms (median, slowest rank)", title="all_reduce of 64 MiB float32 across nodes")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    bl.stamp(fig, bl.machine_label())
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        kind, procs, reps, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        sys.path.insert(0, str(HERE.parent))
        job(kind, procs, reps, out)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 repetitions instead of 30")
    p.add_argument("--results", default=str(HERE / "results"))
    args = p.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    got = launch(results, 5 if args.quick else 30)
    rows = targets(got)
    for r in rows:
        print(f"{r['name']}: {r['ratio']:.2f}x  {'MET' if r['met'] else 'NOT MET'}")
    (results / "nodes.json").write_text(json.dumps({"jobs": got, "targets": rows,
                                                    "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    if got:
        plot(got, results / "nodes.png")
        print(f"plot: {results / 'nodes.png'}")
    return 0 if rows else 1  # a target NOT MET is reported, as bench/run.py does; no figures is a failure


if __name__ == "__main__":
    sys.exit(main())
