"""One fixed run of a shipped preset on a tiny model: what the preset regression test compares.

``PYTHONPATH=tests python -m support.preset_runs`` rewrites ``tests/fixtures/preset_selections.json``
from the current code: do it only when a change of results is intended (and say so in the commit).
"""

import hashlib
import json
import sys

import torch

from kvlab.config.loader import preset_names
from kvlab.data.synthetic import SyntheticImageQA, SyntheticRetrieval
from kvlab.pipeline import Pipeline
from support import e2e
from support.paths import FIXTURES
from support.presets import budgeted_compression, fit_layers, preset_config

RECORD = FIXTURES / "preset_selections.json"
TEXT_MODELS = ("tiny-llama", "tiny-qwen2")
VLM_MODELS = ("tiny-qwen2-vl", "tiny-llava")
TOKEN_BUDGET = 40  # small enough that every token-budget preset evicts on the 60-word prompts
NEW_TOKENS = 6


def is_vlm_preset(name: str) -> bool:
    return preset_config(name)["model"]["model"] != "smollm2-135m"


def preset_models(name: str) -> tuple[str, ...]:
    """The tiny models a preset runs on: VLM presets on the tiny VLMs, the others on the text ones."""
    return VLM_MODELS if is_vlm_preset(name) else TEXT_MODELS


def preset_pipeline(name: str) -> Pipeline:
    """The preset's pipeline (:func:`~support.presets.budgeted_compression`) on its first model."""
    return Pipeline.from_config(budgeted_compression(name, preset_models(name)[0]))


def stored_form_refusal(pipeline: Pipeline) -> str | None:
    """Why a pipeline cannot store its kept prompt entries in another form (a quantizer's codes, a
    channel pruner's narrower keys), as the refusal says it: ``decode`` (a decode policy rescores or
    moves entries), ``outside the cache`` (a selector keeps K/V in a store); None: it can."""
    if pipeline.decode_policy.registry_name != "none":
        return "decode"
    if any(getattr(part.component, "offloads", False) for part in pipeline.walk()):
        return "outside the cache"
    return None


def preset_samples(vlm: bool) -> list:
    """Two text samples, or three VLM samples (two images, one image, text only)."""
    if vlm:
        two = SyntheticImageQA(num_samples=1, images_per_sample=2, seed=3).samples()
        one = SyntheticImageQA(num_samples=1, images_per_sample=1, seed=4).samples()
        return two + one + SyntheticRetrieval(num_samples=1, context_words=30, seed=2).samples()
    return SyntheticRetrieval(num_samples=2, context_words=60, seed=1).samples()


def preset_compression(name: str, model: str, visual_heads) -> dict:
    """The preset's ``model.compression`` with a token budget lowered to :data:`TOKEN_BUDGET`,
    SparseMM's artefact replaced by ``visual_heads(info)`` (a path), a first compressed layer
    (FastV's K) lowered to fit the tiny model (:func:`~support.presets.fit_layers`) and a
    ``threshold`` route rule's threshold lowered to 0: the tiny random models put little attention
    on sinks + window, so SimLayerKV would find no lazy layer and evict nothing."""
    node = preset_config(name)["model"]["compression"]
    budget = node.get("budget") or {}
    if "tokens" in budget and budget.get("window", 0) < TOKEN_BUDGET:
        budget["tokens"] = TOKEN_BUDGET
    head = (node.get("allocate") or {}).get("head") or {}
    if head.get("name") == "sparsemm":
        head["artefact"] = visual_heads(e2e.kvlab_model(model).info)
    rule = (node.get("route") or {}).get("rule") or {}
    if rule.get("name") == "threshold":
        rule["threshold"] = 0.0
    return fit_layers(node, model)


def preset_run(name: str, model: str, visual_heads) -> dict:
    """Generated tokens, kept counts ``[L][B][Hkv]`` and a digest of each layer's kept positions."""
    loaded = e2e.kvlab_model(model)
    pipeline = Pipeline.from_config(preset_compression(name, model, visual_heads))
    result = e2e.run(loaded, pipeline, preset_samples(is_vlm_preset(name)), NEW_TOKENS)
    digests = []
    for report in result.reports:
        selection = report.selection
        positions = torch.where(selection.mask(), selection.indices, -1)
        digests.append(hashlib.sha256(positions.cpu().numpy().tobytes()).hexdigest()[:16])
    return {"tokens": result.tokens, "kept": result.kept.tolist(), "positions": digests}


if __name__ == "__main__":
    import tempfile

    from kvlab.calibration.synthetic import synthetic_visual_heads

    def visual_heads(info):
        return synthetic_visual_heads(info, tempfile.mkdtemp(prefix="kvlab-vh-"))

    record = {
        f"{name}/{model}": preset_run(name, model, visual_heads)
        for name in preset_names()
        for model in preset_models(name)
    }
    RECORD.write_text(json.dumps(record, indent=0, sort_keys=True))
    print(f"wrote {len(record)} runs to {RECORD}", file=sys.stderr)
