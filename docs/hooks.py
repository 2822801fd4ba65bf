"""MkDocs hook: the component reference page, generated from kvlab's registries at build time.

``reference/components.md`` is :func:`kvlab.cli.listing.reference_markdown`, the page
``kvlab list --format markdown`` prints, so the site and the command never disagree.
"""

from __future__ import annotations

import re

from mkdocs.structure.files import File, Files

PAGE = "reference/components.md"


def on_files(files: Files, config) -> Files:
    from kvlab.cli.listing import reference_markdown  # imported at build time, after mkdocs loads

    files.append(File.generated(config, PAGE, content=reference_markdown()))
    return files


ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj):(?=<code)")


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings use Sphinx roles (``:func:`name```); mkdocstrings renders the name as code and
    leaves the role's prefix as text, which is dropped here."""
    return ROLE.sub("", html)
