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
