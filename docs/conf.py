"""Sphinx configuration: Markdown pages through MyST, Google-style docstrings through napoleon."""

from __future__ import annotations

import sys
from pathlib import Path

# Build from a checkout without installing: autodoc imports fsdp2 from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdp2

project = "fsdp2"
author = "the fsdp2 authors"
release = version = getattr(fsdp2, "__version__", "0.1.0")

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"fsdp2 {release}"
