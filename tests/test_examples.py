"""The documented examples print exactly what their .txt files say, and leave nothing behind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from synkhronos.devices import gpu_stack

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _leftovers(pid: int) -> list[str]:
    """Shared-memory names of the fork whose master had ``pid`` (other runs may share /dev/shm)."""
    tag = f"synk.{pid}."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag))


@pytest.mark.parametrize("name", ["example_shared"])
def test_example_output(name):
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{name}.py failed:\n{err}"
    assert out == (EXAMPLES / f"{name}.txt").read_text()
    assert _leftovers(proc.pid) == [], "the example left shared memory or semaphores behind"


#: Where the README's first script runs: this machine, and the CPU stand-in of a GPU box
#: (tests/fakegpu's CuPy and JAX on the CPU, as tests/gpu_scenarios.py installs them).
_FAKE_GPU_SITE = """
import sys
sys.path.insert(0, {tests!r})
import gpu_scenarios
gpu_scenarios._install_fake()
"""


@pytest.mark.parametrize("where", ["here", pytest.param("fake GPU", marks=pytest.mark.slow)])
def test_readme_first_script_prints_what_the_readme_says(tmp_path, where):
    """The README's first script, run as a user would (from another directory), prints the
    lines the README shows under it, and nothing on stderr; where a GPU is usable,
    device="auto" puts both processes on it and one warning (as the README says) is all
    there is on stderr."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## A first script", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    shown = readme.split("## A first script", 1)[1].split("prints", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "first.py"
    script.write_text(code)
    env = dict(os.environ)
    if where == "fake GPU":
        if importlib.util.find_spec("jax") is None:
            pytest.skip("needs jax (a CPU build is enough)")
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_FAKE_GPU_SITE.format(tests=str(ROOT / "tests")))
        env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), FAKE_CUPY_GPUS="1",
                   CUDA_VISIBLE_DEVICES="0")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
    if where == "here" and gpu_stack.auto_gpus() == 0:
        assert proc.stderr == ""
        return
    warned = proc.stderr.splitlines()
    line = 1 + next(i for i, text in enumerate(code.splitlines()) if "synk.fork(" in text)
    assert len(warned) == 2 and warned[0].startswith(f"{script}:{line}: UserWarning: ") and any(
        what in warned[0] for what in ("n_parallel=2 is more than the 1 GPUs", "device='auto' chose")), \
        proc.stderr
    assert "synk.fork(n_parallel=2)" in warned[1], proc.stderr
