"""Every shipped preset keeps exactly the positions and tokens recorded in
``tests/fixtures/preset_selections.json`` on the tiny models (bit for bit: a refactor of the
pipeline or of the presets' YAML must not change what a preset keeps)."""

import json

import pytest
from support.preset_runs import RECORD, preset_models, preset_run

from kvlab.config.loader import preset_names

RECORDED = json.loads(RECORD.read_text())
CASES = [(name, model) for name in preset_names() for model in preset_models(name)]


@pytest.mark.parametrize(("preset", "model"), CASES)
def test_preset_keeps_the_recorded_positions(preset, model, visual_heads):
    key = f"{preset}/{model}"
    rerun = "PYTHONPATH=tests python -m support.preset_runs"
    assert key in RECORDED, f"{key} has no recorded run: run `{rerun}` and commit it"
    got = preset_run(preset, model, visual_heads)
    want = RECORDED[key]
    assert got["kept"] == want["kept"]
    assert got["positions"] == want["positions"]
    assert got["tokens"] == want["tokens"]
