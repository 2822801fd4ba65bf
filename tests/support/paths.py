"""Where things are: the repository root and the tests' fixture files (tests/fixtures)."""

from pathlib import Path

#: the repository's root (kvlab/, kernels/, docs/, notebooks/, tests/)
REPO = Path(__file__).resolve().parents[2]
#: the tests' data files: benchmark and VLM task fixtures, official scores, the preset recording, plugins
FIXTURES = REPO / "tests" / "fixtures"
