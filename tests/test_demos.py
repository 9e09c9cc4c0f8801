"""The introductory example prints its documented output; the demos run and pass their own checks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _leftovers(pid: int) -> list[str]:
    """Shared-memory names of the fork whose master had ``pid``."""
    tag = f"synk.{pid}."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag))


def run_script(path: Path, *args: str, timeout: float = 180) -> tuple[int, str, str, int]:
    """Run a script in a fresh interpreter; returns (exit status, stdout, stderr, pid)."""
    env = dict(os.environ, PYTHONHASHSEED="0", MPLBACKEND="Agg")
    proc = subprocess.Popen([sys.executable, str(path), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, proc.pid


def test_example_intro_output():
    rc, out, err, pid = run_script(ROOT / "examples" / "example_intro.py")
    assert rc == 0, f"example_intro.py failed:\n{err}"
    assert out == (ROOT / "examples" / "example_intro.txt").read_text()
    assert _leftovers(pid) == []


@pytest.mark.parametrize("name, key_line", [
    ("demo_intro", "All results agree with PyTensor."),
    ("demo_reductions", "All reduction checks passed."),
    ("demo_batch", "All batch checks passed."),
    ("demo_shared", "All shared-variable checks passed."),
    ("demo_batch_s", "All batch_s checks passed."),
])
def test_small_demo(name, key_line):
    rc, out, err, pid = run_script(ROOT / "demos" / f"{name}.py", "2")
    assert rc == 0, f"{name}.py exited with {rc}:\n{out}\n{err}"
    assert key_line in out.splitlines(), out
    assert "FAIL" not in out
    assert _leftovers(pid) == []


def _numbers(line: str) -> list[float]:
    """Train loss, validation loss and accuracy (%) of a demo's epoch line."""
    words = line.split("(")[0].replace("%", "").split()
    return [float(words[i + 1]) for i, w in enumerate(words) if w in ("loss", "acc")]


def test_train_digits_short(tmp_path):
    """A short run of the headline demo: 1 process, then 2 (fork again after close)."""
    rc, out, err, pid = run_script(ROOT / "demos" / "train_digits.py", "--workers", "2", "--epochs", "5",
                                   "--no-progress", "--results", str(tmp_path), timeout=300)
    assert rc == 0, f"train_digits.py exited with {rc}:\n{out}\n{err}"
    assert "speed-up of 2 processes over 1:" in out
    assert "(reached the 95% target)" in out
    finals = [_numbers(line) for line in out.splitlines()
              if line.startswith(("1 proc  epoch  5", "2 proc  epoch  5"))]
    assert len(finals) == 2, out
    # the data-parallel step computes what one process computes, up to float32 rounding
    # (summed in another order), which training amplifies a little over the epochs
    assert finals[0] == pytest.approx(finals[1], rel=0.05, abs=1e-3)
    assert (tmp_path / "train_digits_mlp.png").stat().st_size > 10_000
    assert _leftovers(pid) == []


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("keras") is None,
                    reason="needs PyTorch and Keras 3 (pip install -e '.[test,demo]')")
# both demos are slow (make test-slow): make test keeps Keras's callback and PyTorch's param
# manager in test_mv_frameworks.py and test_multiverso.py
@pytest.mark.parametrize("name", [pytest.param("mv_torch_digits", marks=pytest.mark.slow),
                                  pytest.param("mv_keras_digits", marks=pytest.mark.slow)])
def test_parameter_server_demos_short(name, tmp_path):
    """A short run of each framework demo on the tables: 1 worker (a child process), then 2."""
    rc, out, err, pid = run_script(ROOT / "demos" / f"{name}.py", "--workers", "2", "--epochs", "3",
                                   "--no-progress", "--results", str(tmp_path), timeout=300)
    assert rc == 0, f"{name}.py exited with {rc}:\n{out}\n{err}"
    assert "speed-up of 2 workers over 1:" in out, out
    assert "(reached the 93% target)" in out, out
    finals = [line for line in out.splitlines() if line.startswith(("1 worker   epoch  3",
                                                                    "2 workers  epoch  3"))]
    assert len(finals) == 2, out
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert _leftovers(pid) == []
