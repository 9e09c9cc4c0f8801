"""The documented examples print exactly what their .txt files say, and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_readme_first_script_prints_what_the_readme_says(tmp_path):
    """The README's first script, run as a user would (from another directory), prints the
    lines the README shows under it, and nothing on stderr."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## A first script", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    shown = readme.split("## A first script", 1)[1].split("prints", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "first.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
    assert proc.stderr == ""
