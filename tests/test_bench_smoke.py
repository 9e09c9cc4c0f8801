"""bench/run.py --quick --only synk runs end to end and writes the JSON it promises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"

TARGET_COUNT = 7  # the five targets of issue 6; all_reduce and the two collectives split out


@pytest.mark.slow
def test_bench_quick_synk_only(tmp_path):
    cmd = [sys.executable, str(RUN), "--quick", "--only", "synk", "--results", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"bench/run.py failed:\n{out}\n{err}"

    path = tmp_path / "latest.json"
    assert path.exists(), f"no JSON written:\n{out}"
    result = json.loads(path.read_text())
    assert set(result) >= {"meta", "parts", "collectives", "training", "targets", "plots"}
    assert result["meta"]["quick"] is True
    assert result["meta"]["only"] == ["synk"]

    parts = result["parts"]
    assert set(parts) == {"synk_first", "synk", "synk_train_2", "synk_train_1"}, parts.keys()
    assert set(parts["synk_first"]["first_call"]) >= {"master_first_call_s", "workers_first_call_s",
                                                     "distribute_s", "master_build_s"}
    synk = parts["synk"]
    assert "error" not in synk, synk.get("error")
    assert set(synk) >= {"overhead", "scatter", "reduce_outputs", "collectives"}
    assert synk["overhead"]["overhead_us"] > 0
    for op in ("all_reduce", "broadcast", "gather"):
        assert set(synk["collectives"][op]) == {"4B", "4KiB", "4MiB"}
        assert all(v["median"] > 0 for v in synk["collectives"][op].values())
    assert set(synk["scatter"]) == {"64KiB", "4MiB"}
    assert set(synk["reduce_outputs"]) >= {"avg", "sum", "gather", "None"}
    assert parts["synk_train_2"]["train"]["n_parallel"] == 2
    assert parts["synk_train_1"]["train"]["n_parallel"] == 1
    assert parts["synk_train_1"]["train"]["threads_per_process"] == 1

    assert [r["size"] for r in result["collectives"] if r["op"] == "all_reduce"] == ["4B", "4KiB", "4MiB"]
    assert all(r["mpi"] is None and r["gloo"] is None for r in result["collectives"])
    assert [r["batch"] for r in result["training"]] == [64, 512]

    targets = result["targets"]
    assert len(targets) == TARGET_COUNT
    for t in targets:
        assert t["status"] in ("MET", "NOT MET", "n/a")
    # peers were not run, so the targets that compare with Open MPI cannot be judged
    assert {t["status"] for t in targets if "Open MPI" in t["target"]} == {"n/a"}
    assert "\nTargets" in out and "Goals (microsecond calls)" in out
    assert any(line.strip().startswith("[") and "MET" in line for line in out.splitlines())

    if importlib.util.find_spec("matplotlib") is not None:
        names = {Path(p).name for p in result["plots"]}
        assert {"collectives.png", "training.png", "per_call.png"} <= names
        assert all((tmp_path / n).stat().st_size > 0 for n in names)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None
                    or not os.access(Path(sys.executable).parent / "mpirun", os.X_OK),
                    reason="needs mpi4py and Open MPI's mpirun next to this Python")
def test_nodes_bench_quick(tmp_path):
    """bench/nodes_bench.py --quick runs its four mpirun jobs and writes its JSON and plot."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "nodes_bench.py"), "--quick",
                           "--results", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"nodes_bench.py failed:\n{done.stdout}\n{done.stderr}"
    result = json.loads((tmp_path / "nodes.json").read_text())
    assert set(result["jobs"]) == {"synk 2x1", "synk 2x2", "mpi 2", "mpi 4"}, done.stdout
    for job in result["jobs"].values():
        assert len(job["times"]) == 5 and all(t > 0 for t in job["times"])
    assert result["jobs"]["synk 2x2"]["processes"] == 4 and result["jobs"]["synk 2x2"]["nodes"] == 2
    assert [t["name"].split(":")[0] for t in result["targets"]] == ["synk 2x1 vs mpi 2", "synk 2x2 vs mpi 4"]
    assert (tmp_path / "nodes.png").stat().st_size > 5_000


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax (a CPU build is enough)")
def test_fakegpu_bench_quick_through_run(tmp_path):
    """bench/run.py --quick --only fakegpu runs bench/fakegpu_bench.py on the CuPy stand-in:
    every row measured, the issue-48 target judged, the table printed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(RUN), "--quick", "--only", "fakegpu", "--no-plots",
                           "--results", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"bench/run.py failed:\n{done.stdout}\n{done.stderr}"
    result = json.loads((tmp_path / "latest.json").read_text())
    part = result["parts"]["fakegpu"]
    assert "error" not in part and "skipped" not in part, part
    assert set(part["rows"]) == {"stand-in allReduce 4 B", "synk.all_reduce 4 B",
                                 "plain JAX-mode call + np.asarray", "plain JAX-mode call + block_until_ready",
                                 "synk call, numpy outputs", "synk call, device_outputs=True"}
    for row in part["rows"].values():
        assert len(row["rounds_s"]) == part["rounds"] and row["best_s"] == min(row["rounds_s"]) > 0
    assert part["target"]["status"] in ("MET", "NOT MET")
    assert part["all_reduce_ratio"] == pytest.approx(
        part["rows"]["synk.all_reduce 4 B"]["best_s"] / part["rows"]["stand-in allReduce 4 B"]["best_s"])
    assert [t["status"] for t in result["targets_48"]] == [part["target"]["status"]]
    assert "Stand-in GPU" in done.stdout and "Issue 48 (stand-in GPU)" in done.stdout
