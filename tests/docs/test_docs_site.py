"""The documentation site builds with warnings as errors (`mkdocs build --strict`), with the
component reference generated from the registries and the Python API read from the docstrings."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest
from support.paths import REPO


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="the docs packages are not installed (they come with the dev extra: pip install -e '.[dev]')",
)
def test_docs_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"mkdocs build --strict: {seconds:.1f} s")
    components = (tmp_path / "site" / "reference" / "components" / "index.html").read_text()
    for name in ("window_attention", "mixkv", "adakv", "text_prior", "latch", "h2o", "query_agnostic"):
        assert f"<code>{name}</code>" in components, name
    assert "Li et al. 2024" in components  # the paper each component follows
    api = (tmp_path / "site" / "reference" / "python_api" / "index.html").read_text()
    assert "compress_and_generate" in api and "load_pipeline" in api  # from the docstrings
    for page in ("architecture", "evaluation", "methods/mixkv", "notebooks"):
        assert (tmp_path / "site" / page / "index.html").is_file()
