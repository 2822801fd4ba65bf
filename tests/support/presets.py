"""A shipped preset's compression with another budget, on the tiny models: the cases of the
method invariants (tests/engine/test_methods.py) and of the tests that reuse them."""

import copy
import functools
import tempfile

from kvlab.calibration.synthetic import synthetic_visual_heads
from kvlab.config.loader import merge, resolve
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.pipeline import Pipeline
from support.e2e import kvlab_model


@functools.cache
def _resolved(name: str) -> dict:
    return resolve([name], [])


def preset_config(name: str) -> dict:
    """``resolve([name], [])`` of a shipped preset, a fresh copy the caller may edit.

    The YAML is parsed once per session: PyYAML's pure-Python parser made ``resolve`` about a
    third of a preset run on the tiny models, and the preset matrices resolve each preset in
    every case (and at collection). The shipped files do not change during a session.
    """
    return copy.deepcopy(_resolved(name))


@functools.cache
def visual_heads_artefact(model: str) -> str:
    """A seeded, skewed visual-head artefact for a tiny model (SparseMM presets need one)."""
    return synthetic_visual_heads(kvlab_model(model).info, tempfile.mkdtemp(prefix="kvlab-vh-"))


def fit_layers(node: dict, model: str) -> dict:
    """``node`` with a layer allocator's first compressed layer (``allocate.layer.layer``, FastV's K)
    lowered to the model's last layer: the tiny models have two or three layers."""
    layer = (node.get("allocate") or {}).get("layer") or {}
    if "layer" in layer:
        layer["layer"] = min(layer["layer"], kvlab_model(model).info.num_layers - 1)
    return node


def budgeted_compression(name: str, model: str = "tiny-qwen2", **budget) -> dict:
    """The preset's compression node; ``budget`` fields are merged in (``tokens`` replaces a ratio);
    a first compressed layer is lowered to fit ``model`` (:func:`fit_layers`)."""
    node = preset_config(name)["model"]["compression"]
    if budget:
        node["budget"] = merge(node["budget"], budget)
    head = node.get("allocate", {}).get("head", {})
    if head.get("name") == "sparsemm":
        head["artefact"] = visual_heads_artefact(model)
    return fit_layers(node, model)


def budgeted_pipeline(name: str, model: str = "tiny-qwen2", **budget) -> Pipeline:
    """The pipeline of :func:`budgeted_compression`."""
    return Pipeline.from_config(budgeted_compression(name, model, **budget))


@functools.cache
def retrieval_samples(n: int = 2, words: int = 60) -> list:
    """``n`` seeded synthetic retrieval samples of ``words`` context words (the same every call)."""
    return SyntheticRetrieval(num_samples=n, context_words=words, seed=1).samples()
