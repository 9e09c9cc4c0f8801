"""Sphinx configuration for the synkhronos documentation (built offline: no intersphinx)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "synkhronos"
author = "the synkhronos authors"
copyright = "the synkhronos authors"

try:
    from synkhronos import __version__ as release
except ImportError:  # autodoc will report the failure itself
    release = "0.1.0"
version = release

# The Keras helpers' API needs Keras and a backend: the docs use the PyTorch backend, and
# mock Keras where it (or PyTorch) is not installed.
os.environ.setdefault("KERAS_BACKEND", "torch")
try:
    import keras  # noqa: F401
    autodoc_mock_imports = []
except ImportError:
    autodoc_mock_imports = ["keras"]

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# Google-style docstrings (Args/Returns/Raises), as the package writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"undoc-members": False}

templates_path = []
exclude_patterns = ["_build"]
root_doc = "index"
language = "en"

# pydata-sphinx-theme: the pages sit in the top bar (no left column: the table of contents is
# flat), "On this page" on the right, and code blocks wider than alabaster's fixed 940 px column.
# docs/pymc.rst shows measured tables 122 columns wide: that page gives up the right column and
# lists its sections at the top instead, and _theme/synk.css lets its article grow past the
# theme's 60em, so that at 1280 px every code block and table shows whole (tests/test_docs.py).
html_theme = "pydata_sphinx_theme"
html_title = "synkhronos"
html_theme_options = {
    "navbar_align": "left",
    "header_links_before_dropdown": 4,
    "secondary_sidebar_items": {"**": ["page-toc", "sourcelink"], "pymc": []},
}
html_sidebars = {"**": []}
html_static_path = ["_theme"]
html_css_files = ["synk.css"]
