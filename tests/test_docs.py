"""The documentation builds with Sphinx, warnings treated as errors (as ``make docs`` does)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from html import unescape
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
    for page in ("index", "install", "tutorial", "shared", "deep_learning", "gpu", "gpu-validation",
                 "nodes", "porting", "performance", "multiverso", "internals", "api", "extensions_api"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), f"{page}.html was not built"
    gpu = (tmp_path / "html" / "gpu.html").read_text()
    assert 'href="gpu-validation.html"' in gpu, "the GPU page does not link the validation page"
    api = (tmp_path / "html" / "api.html").read_text()
    assert "synkhronos.fork" in api and "synkhronos.all_reduce" in api, "API page lacks the docstrings"
    for page in ("index", "pymc"):
        assert_code_blocks_fit((tmp_path / "html" / f"{page}.html").read_text(), page)


#: Columns of a code block that show whole on a 1280 px screen (pydata-sphinx-theme, its
#: monospace at 14 px, about 8.4 px a column): 894 px for the code in a page's column beside
#: "On this page", 1199 px for a block of class "wide" (docs/_theme/synk.css gives its page the
#: width), less the block's padding. Measured with headless Chromium; kept a few columns short.
FITS_COLUMNS, FITS_COLUMNS_WIDE = 100, 136


def assert_code_blocks_fit(html: str, page: str) -> None:
    """No line of a code block on ``page`` is cut (made to scroll) at 1280 px."""
    assert "pydata-sphinx-theme" in html, f"{page}.html is not built with pydata-sphinx-theme"
    blocks = re.findall(r'<div class="([^"]*)highlight[^"]*"><div class="highlight"><pre>(.*?)</pre>', html, re.S)
    assert blocks, f"no code block found in {page}.html"
    for classes, block in blocks:
        wide = "wide" in classes.split()
        assert not (wide and "bd-sidebar-secondary" in html), f"{page}.html: a wide block beside a right column"
        limit = FITS_COLUMNS_WIDE if wide else FITS_COLUMNS
        text = unescape(re.sub(r"<[^>]+>", "", block))
        longest = max(text.splitlines(), key=len)
        assert len(longest) <= limit, (f"{page}.html: a code line of {len(longest)} columns is cut at "
                                       f"1280 px (at most {limit}): {longest!r}")


#: What a reader sees: the README, the docs' pages, the changelog and the downloads they offer.
USER_PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.rst")),
              *sorted((ROOT / "docs" / "_static").rglob("*.txt"))]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_user_page_names_an_internal_issue(page):
    text = page.read_text()
    found = re.findall(r"(?i)\bissues? \d+|(?<![\w&])#\d+\b", text)
    assert not found, f"{page.relative_to(ROOT)} names internal issue numbers: {sorted(set(found))}"


def test_every_kept_perf_file_is_referenced():
    """docs/_static/perf holds only what a page shows or offers for download."""
    pages = "".join(p.read_text() for p in (ROOT / "docs").glob("*.rst"))
    unreferenced = [f.name for f in (ROOT / "docs" / "_static" / "perf").iterdir() if f.name not in pages]
    assert unreferenced == []
