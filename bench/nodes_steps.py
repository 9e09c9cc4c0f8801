"""Small and large steps across nodes: a 4-byte all_reduce, a 64 MiB all_reduce, a
4-byte broadcast and a small call (with a ``sum`` output, and with a ``sum`` and a
``gather`` output), under
``mpirun -np 2`` on this machine (2 nodes of 1 process each),
beside mpi4py's own calls on the same bytes in the same job (the floors).

    python bench/nodes_steps.py [--rounds 3] [--against OTHER_TREE] [--np 2] [--processes 1] [--profile] [--fastest]

The mpi4py rows: blocking ``Allreduce`` of 4 B and 64 MiB, ``Bcast`` of 4 B; ``Iallgather`` of a
512-byte slot then a Python ``Test`` loop (the floor of a step that never blocks
inside MPI and carries a header); ``Iallreduce`` of 64 MiB into another buffer
then a ``Test`` loop, without and with a 64 MiB copy back, and without on shared
mappings of 4 KiB pages (what synk's homes in POSIX shared memory are). ``--np 1`` gives a
step's Python alone (the exchange completes at once); ``--profile`` prints node
0's cProfile of 4-byte all_reduce steps. ``--processes 2`` forks 2 processes per node
(nodes of several processes: the node's own steps, or its master's direct plan, besides
the exchange among node masters).

Each round launches one ``mpirun -np 2`` job per tree (this checkout, and with
``--against`` another checkout of synkhronos, e.g. a ``git worktree`` of an
earlier commit), alternating, so both see the same machine; each job times
blocks of steps and keeps the median block (``--fastest``: the fastest, the steadier
figure where other work shares the machine). Prints per step the median over
rounds, in microseconds, and the ratio of this tree to the other.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MPIRUN = Path(sys.executable).parent / "mpirun"
MEASURES = ("all_reduce 4 B", "all_reduce 64 MiB", "broadcast 4 B", "call 8 rows", "call 8 rows, sum + gather",
            "mpi4py Allreduce 4 B", "mpi4py Allreduce 64 MiB", "mpi4py Bcast 4 B", "mpi4py Iallgather 512 B + Test",
            "mpi4py Iallreduce 64 MiB + Test",
            "mpi4py Iallreduce 64 MiB + Test + copy", "mpi4py Iallreduce 64 MiB + Test, shared pages")
#: Per measure, the measure it is compared with in the printed ratio (synk against MPI's own).
AGAINST = {"all_reduce 4 B": "mpi4py Allreduce 4 B", "all_reduce 64 MiB": "mpi4py Allreduce 64 MiB",
           "broadcast 4 B": "mpi4py Bcast 4 B",
           "mpi4py Iallgather 512 B + Test": "mpi4py Allreduce 4 B",
           "mpi4py Iallreduce 64 MiB + Test": "mpi4py Allreduce 64 MiB",
           "mpi4py Iallreduce 64 MiB + Test + copy": "mpi4py Allreduce 64 MiB",
           "mpi4py Iallreduce 64 MiB + Test, shared pages": "mpi4py Allreduce 64 MiB"}


def mpi_steps(np):
    """The mpi4py rows: ``{name: (step, count)}`` on a duplicate of COMM_WORLD."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    size = comm.Get_size()
    small, small_out = np.ones(1, dtype=np.float32), np.empty(1, dtype=np.float32)
    large, large_out = np.ones(16 << 20, dtype=np.float32), np.empty(16 << 20, dtype=np.float32)
    slot, slots = np.zeros(512, dtype=np.uint8), np.empty((size, 512), dtype=np.uint8)

    def test_loop(req):
        while not req.Test():
            pass

    # the same on shared mappings of 4 KiB pages, as synk's homes in POSIX shared memory
    # (numpy's own large buffers may get transparent huge pages, tmpfs's do not here)
    maps = [mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED) for _ in range(2)]
    shared, shared_out = (np.frombuffer(m, dtype=np.float32) for m in maps)
    shared[:] = 1

    def iallreduce(copy, send=large, recv=large_out):
        def step():
            test_loop(comm.Iallreduce(send, recv, MPI.MAX))
            if copy:
                np.copyto(send, recv)
        return step

    return {"mpi4py Allreduce 4 B": (lambda: comm.Allreduce(small, small_out, MPI.MAX), 20000),
            "mpi4py Allreduce 64 MiB": (lambda: comm.Allreduce(large, large_out, MPI.MAX), 10),
            "mpi4py Bcast 4 B": (lambda: comm.Bcast(small_out, root=0), 20000),
            "mpi4py Iallgather 512 B + Test": (
                lambda: test_loop(comm.Iallgather([slot, MPI.BYTE], [slots, MPI.BYTE])), 20000),
            "mpi4py Iallreduce 64 MiB + Test": (iallreduce(False), 10),
            "mpi4py Iallreduce 64 MiB + Test + copy": (iallreduce(True), 10),
            "mpi4py Iallreduce 64 MiB + Test, shared pages": (iallreduce(False, shared, shared_out), 10)}, comm


def timed(step, n, fastest: bool = False) -> float:
    """Median (``fastest``: the fastest) of 7 blocks of ``n`` steps (after a warm-up),
    microseconds per step."""
    for _ in range(max(2, n // 20)):
        step()
    blocks = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        blocks.append((time.perf_counter() - t0) / n * 1e6)
    return min(blocks) if fastest else statistics.median(blocks)


def node(out: str, profile: bool = False, processes: int = 1, fastest: bool = False) -> None:
    """One node of a job: time each kind of step, node 0 writes the medians."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(processes, device="cpu")
    small = pytensor.shared(np.ones(1, dtype=np.float32), name="small")
    large = pytensor.shared(np.ones(16 << 20, dtype=np.float32), name="large")
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), name="f")
    fg = synk.function([x], [(x.sum(axis=0), "sum"), (x * 2, "gather")], name="fg")
    synk.function([], [(small.sum(), "sum"), (large.sum(), "sum")], name="h")
    synk.distribute()
    rows = np.ones((8, 4))
    steps = {"all_reduce 4 B": (lambda: synk.all_reduce(small, "max"), 2000),
             "all_reduce 64 MiB": (lambda: synk.all_reduce(large, "max"), 10),
             "broadcast 4 B": (lambda: synk.broadcast(small), 2000),
             "call 8 rows": (lambda: f(rows), 2000), "call 8 rows, sum + gather": (lambda: fg(rows), 1000)}
    raw, raw_comm = mpi_steps(np)
    steps.update(raw)
    got = {name: timed(step, n, fastest) for name, (step, n) in steps.items()}
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [synk.all_reduce(small, "max") for _ in range(2000)])
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        got["profile"] = text.getvalue()
    raw_comm.Free()
    if synk.world().node == 0:
        Path(out).write_text(json.dumps(got))
    synk.close()


def job(tree: Path, np_: int = 2, profile: bool = False, processes: int = 1, fastest: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        env = dict(os.environ, PYTHONPATH=str(tree), OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTENSOR_FLAGS="mode=FAST_RUN")
        cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--mca", "osc", "^ucx",
               "-x", "PYTHONPATH", sys.executable, str(Path(__file__).resolve()), "--node", str(out),
               "--processes", str(processes)]
        cmd += ["--profile"] if profile else []
        cmd += ["--fastest"] if fastest else []
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: mpirun exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def _thp() -> str:
    """Transparent huge pages for anonymous memory and for shared memory (tmpfs)."""
    out = []
    for name in ("enabled", "shmem_enabled"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
            out.append(text[text.index("[") + 1:text.index("]")])
        except (OSError, ValueError):
            out.append("?")
    return "/".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="another checkout of synkhronos to compare with")
    p.add_argument("--np", type=int, default=2, help="nodes (copies under mpirun; 1: a step's Python alone)")
    p.add_argument("--profile", action="store_true", help="print node 0's profile of 4-byte all_reduce steps")
    p.add_argument("--processes", type=int, default=1, help="processes per node (synk.fork's count)")
    p.add_argument("--fastest", action="store_true",
                   help="each job's figure is its fastest block, not the median (steadier on a shared machine)")
    a = p.parse_args()
    if a.node:
        node(a.node, a.profile, a.processes, a.fastest)
        return
    trees = {"this": HERE.parent}
    if a.against:
        trees["other"] = Path(a.against).resolve()
    runs = {k: [] for k in trees}
    for r in range(a.rounds):
        for k, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            runs[k].append(job(tree, a.np, a.profile, a.processes, a.fastest))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    block = "fastest" if a.fastest else "median"
    print(f"{cpu}, {os.cpu_count()} cores; THP {_thp()}; mpirun -np {a.np}, {a.processes} process(es) per node; "
          f"median of {a.rounds} rounds (us) of each job's {block} block; 'x MPI': this tree's row over the "
          "mpi4py row named in the same job, the median over rounds, then each round's")
    for m in MEASURES:
        med = {k: statistics.median(run[m] for run in runs[k]) for k in trees}
        line = f"  {m:38s} this {med['this']:10.1f}"
        if m in AGAINST:
            each = [run[m] / run[AGAINST[m]] for run in runs["this"]]
            line += f" ({statistics.median(each):6.2f} x MPI; rounds {' '.join(f'{x:.2f}' for x in each)})"
        if "other" in med:
            line += f"   other {med['other']:10.1f}"
            if m in AGAINST:
                each = [run[m] / run[AGAINST[m]] for run in runs["other"]]
                line += f" ({statistics.median(each):6.2f} x MPI; rounds {' '.join(f'{x:.2f}' for x in each)})"
            line += f"   this/other {med['this'] / med['other']:.3f}"
        print(line)
    if a.profile:
        print(runs["this"][-1]["profile"])


if __name__ == "__main__":
    main()
