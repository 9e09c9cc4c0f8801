"""Small and large steps across nodes: a 4-byte all_reduce, a 64 MiB all_reduce and
a small call, under ``mpirun -np 2`` on this machine (2 nodes of 1 process each).

    python bench/nodes_steps.py [--rounds 3] [--against OTHER_TREE]

Each round launches one ``mpirun -np 2`` job per tree (this checkout, and with
``--against`` another checkout of synkhronos, e.g. a ``git worktree`` of an
earlier commit), alternating, so both see the same machine; each job times
blocks of steps and keeps the median block. Prints per step the median over
rounds, in microseconds, and the ratio of this tree to the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MPIRUN = Path(sys.executable).parent / "mpirun"
MEASURES = ("all_reduce 4 B", "all_reduce 64 MiB", "call 8 rows")


def node(out: str) -> None:
    """One node of a job: time each kind of step, node 0 writes the medians."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(1, device="cpu")
    small = pytensor.shared(np.ones(1, dtype=np.float32), name="small")
    large = pytensor.shared(np.ones(16 << 20, dtype=np.float32), name="large")
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), name="f")
    synk.function([], [(small.sum(), "sum"), (large.sum(), "sum")], name="h")
    synk.distribute()
    rows = np.ones((8, 4))
    steps = {"all_reduce 4 B": (lambda: synk.all_reduce(small, "max"), 2000),
             "all_reduce 64 MiB": (lambda: synk.all_reduce(large, "max"), 10),
             "call 8 rows": (lambda: f(rows), 2000)}
    got = {}
    for name, (step, n) in steps.items():
        for _ in range(max(2, n // 20)):
            step()
        blocks = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            blocks.append((time.perf_counter() - t0) / n * 1e6)
        got[name] = statistics.median(blocks)
    if synk.world().node == 0:
        Path(out).write_text(json.dumps(got))
    synk.close()


def job(tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        env = dict(os.environ, PYTHONPATH=str(tree), OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTENSOR_FLAGS="mode=FAST_RUN")
        cmd = [str(MPIRUN), "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca", "osc", "^ucx",
               "-x", "PYTHONPATH", sys.executable, str(Path(__file__).resolve()), "--node", str(out)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: mpirun exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="another checkout of synkhronos to compare with")
    a = p.parse_args()
    if a.node:
        node(a.node)
        return
    trees = {"this": HERE.parent}
    if a.against:
        trees["other"] = Path(a.against).resolve()
    runs = {k: [] for k in trees}
    for r in range(a.rounds):
        for k, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            runs[k].append(job(tree))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores; mpirun -np 2, 1 process per node; median of {a.rounds} rounds (us)")
    for m in MEASURES:
        med = {k: statistics.median(run[m] for run in runs[k]) for k in trees}
        line = f"  {m:20s} this {med['this']:10.1f}"
        if "other" in med:
            line += f"   other {med['other']:10.1f}   this/other {med['this'] / med['other']:.3f}"
        print(line)


if __name__ == "__main__":
    main()
