"""The documentation builds with Sphinx, warnings treated as errors (as ``make docs`` does)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("sphinx") is None,
                    reason="sphinx is not installed: pip install -e '.[docs]' (or run make docs)")
def test_docs_build_without_warnings(tmp_path):
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"sphinx failed or warned:\n{proc.stdout}\n{proc.stderr}"
    for page in ("index", "install", "tutorial", "shared", "deep_learning", "gpu", "porting",
                 "performance", "internals", "api", "extensions_api"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), f"{page}.html was not built"
    api = (tmp_path / "html" / "api.html").read_text()
    assert "synkhronos.fork" in api and "synkhronos.all_reduce" in api, "API page lacks the docstrings"
