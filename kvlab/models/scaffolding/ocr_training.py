"""Training and report of ``smollm2-ocr``'s classifier (:mod:`kvlab.models.scaffolding.ocr`, step 4).

The classifier maps the layernormed power spectrum of a patch to one score per glyph. It is trained
(Adam, seeded batches, one thread: bit-identical in every process) on every patch of
:attr:`~kvlab.models.scaffolding.ocr.BuildSize.scenes` random scenes (each glyph in both fonts, every
size, ink and shift the scenes draw; textures, icons, gradients and noise for the background):
cross-entropy over the glyphs, then with the squared distance of the projector's detectors from the
one-hot added, so that scores land on the detectors' two sides and a patch becomes exactly its
token's embedding. The report: per-patch nearest-token accuracy (L2 over SmolLM2's 49152 tokens) on
:attr:`~kvlab.models.scaffolding.ocr.BuildSize.held_out` scenes from a seed the training never saw,
for text patches in each font and for background patches.

``python -m kvlab.models.scaffolding.ocr_training`` prints the report stored with the shipped
classifier; ``--train`` trains it again (about a minute on one core) and rewrites the file.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvlab.data import scenes
from kvlab.models.common import one_thread, seeded
from kvlab.models.scaffolding import ocr, smollm2
from kvlab.models.scaffolding.ocr import BUILD, BuildSize
from kvlab.models.vlm import llava_images


def classifier_inputs(vlm: torch.nn.Module, config: Any, images: list[Any], chunk: int = 8) -> torch.Tensor:
    """``[len(images) * 256, F]`` float32: what encoder layer 2's MLP reads of each patch (its
    layernorm's output on the spectrum channels), in image order.

    Computed by the tower's own modules without its attention blocks, whose projections are zero at
    this stage (each adds an exact 0 to the residual stream): the same values, a third of the work.
    """
    adapter = llava_images(config)
    tower = vlm.model.vision_tower
    first, second = tower.encoder.layers
    spectrum = ocr.layout().spectrum_slots
    out = []
    for start in range(0, len(images), chunk):
        pixels = adapter.process(images[start : start + chunk])[0]["pixel_values"]
        with torch.no_grad():
            hidden = tower.pre_layrnorm(tower.embeddings(pixels))[:, 1:]  # LLaVA drops the CLS token
            hidden = hidden + first.mlp(first.layer_norm2(hidden))
            normed = second.layer_norm2(hidden)
        out.append(normed[..., spectrum].reshape(-1, spectrum.stop - spectrum.start))
    return torch.cat(out)


def random_scenes(count: int, seed: int) -> tuple[list[Any], list[str], list[str]]:
    """``count`` scenes for training or the report: each puts random glyphs in a random share of
    its cells (20 to 160 of 256), so text and every kind of background come in both plain and
    crowded scenes. Returns the images, every patch's label and every patch's font (``""`` for
    background), in image order."""
    rng = random.Random(f"smollm2-ocr:{seed}")
    images, labels, fonts = [], [], []
    for _ in range(count):
        cells = rng.sample(range(scenes.CELLS_PER_IMAGE), rng.randrange(20, 160))
        scene = scenes.render_scene({i: rng.choice(scenes.GLYPHS[1:]) for i in cells}, rng)
        images.append(scene.image)
        labels += scene.labels
        fonts += scene.fonts
    return images, labels, fonts


def train_reader(inputs: torch.Tensor, classes: torch.Tensor, size: BuildSize) -> dict[str, torch.Tensor]:
    """Train encoder layer 2's classifier ``z = W2 gelu(W1 x + b1) + b2``.

    Args:
        inputs: ``[N, F]`` :func:`classifier_inputs`; classes: ``[N]`` each patch's glyph index.
        size: steps, batch, learning rate.

    Returns:
        ``W1 [ocr.CLASSIFIER_WIDTH, F]`` (the inputs' standardisation folded in), ``b1``, ``W2 [G,
        ocr.CLASSIFIER_WIDTH]``, ``b2``, float32.
    """
    mean, std = inputs.mean(0), inputs.std(0) + 1e-6
    x = (inputs - mean) / std
    glyph_count = len(scenes.GLYPHS)
    generator = torch.Generator().manual_seed(ocr.SEED)
    with seeded(ocr.SEED):
        first, second = (
            torch.nn.Linear(x.shape[1], ocr.CLASSIFIER_WIDTH),
            torch.nn.Linear(ocr.CLASSIFIER_WIDTH, glyph_count),
        )
    optimizer = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=size.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, size.learning_rate, total_steps=size.steps)
    for step in range(size.steps):
        batch = torch.randint(len(x), (size.batch,), generator=generator)
        scores, y = second(torch.nn.functional.gelu(first(x[batch]))), classes[batch]
        loss = torch.nn.functional.cross_entropy(scores, y)
        if step >= size.steps - size.detector_steps:
            one_hot = torch.nn.functional.one_hot(y, glyph_count).float()
            loss = loss + (ocr.detectors(scores) - one_hot).pow(2).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        return {
            "W1": first.weight / std[None, :],
            "b1": first.bias - first.weight @ (mean / std),
            "W2": second.weight.clone(),
            "b2": second.bias.clone(),
        }


def nearest_tokens(embedded: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[N]`` the row of ``table [V, D]`` nearest (L2) to each row of ``embedded [N, D]``:
    ``argmax_v (2 e . t_v - |t_v|^2)``, one matrix product."""
    return (2 * embedded @ table.T - table.pow(2).sum(-1)).argmax(-1)


def evaluate(vlm: torch.nn.Module, config: Any, ids: list[int], size: BuildSize) -> dict[str, Any]:
    """Per-patch nearest-token accuracy (L2 over SmolLM2's 49152 tokens) on ``size.held_out``
    scenes from :data:`ocr.HELD_OUT_SEED` (renderings the training never saw: other placements,
    fonts, sizes, inks, shifts, textures, icons and noise): text patches, each font's, background
    patches, and the glyphs most often misread."""
    images, labels, fonts = random_scenes(size.held_out, ocr.HELD_OUT_SEED)
    adapter = llava_images(config)
    table = vlm.get_input_embeddings().weight[: smollm2.load_config().vocab_size].detach()
    index = {glyph: i for i, glyph in enumerate(scenes.GLYPHS)}
    nearest: list[int] = []
    for start in range(0, len(images), 8):
        pixels = adapter.process(images[start : start + 8])[0]["pixel_values"]
        with torch.no_grad():
            embedded = vlm.model.get_image_features(pixel_values=pixels).pooler_output
        nearest += nearest_tokens(torch.cat(list(embedded)).reshape(-1, table.shape[1]), table).tolist()
    right = [nearest[i] == ids[index[label]] for i, label in enumerate(labels)]

    def share(patches: list[int]) -> float:
        return round(sum(right[i] for i in patches) / max(1, len(patches)), 4)

    text = [i for i, label in enumerate(labels) if label]
    misread: dict[str, int] = {}
    for i in text:
        if not right[i]:
            misread[labels[i]] = misread.get(labels[i], 0) + 1
    background = [i for i, label in enumerate(labels) if not label]
    return {
        "held_out_scenes": size.held_out,
        "text_patches": len(text),
        "text_accuracy": share(text),
        **{f"text_accuracy_{font}": share([i for i in text if fonts[i] == font]) for font in scenes.FONTS},
        "background_patches": len(background),
        "background_accuracy": share(background),
        "misread": dict(sorted(misread.items(), key=lambda kv: -kv[1])[:12]),
    }


def train(size: BuildSize = BUILD, dst: Path | None = None) -> dict[str, Any]:
    """Train the classifier and write it to ``dst`` (default: the file kvlab ships,
    :data:`~kvlab.models.scaffolding.ocr.TRAINED_FILE`), with the held-out report in its metadata.
    Deterministic: one thread, seeded scenes and batches (``tests/models/test_ocr.py`` trains a
    small size in two processes)."""
    started = time.perf_counter()
    with one_thread():  # the same reductions in every process
        tokenizer, config, vlm = ocr.spectrum_model()
        images, labels, _ = random_scenes(size.scenes, ocr.SEED)
        index = {glyph: i for i, glyph in enumerate(scenes.GLYPHS)}
        classes = torch.tensor([index[label] for label in labels])
        trained = train_reader(classifier_inputs(vlm, config, images), classes, size)
        ocr.set_reader(vlm, trained, tokenizer)
        report = evaluate(vlm, config, ocr.glyph_token_ids(tokenizer), size)
    report.update(
        digest=ocr.digest(size), training_patches=len(labels), seconds=round(time.perf_counter() - started, 1)
    )
    target = ocr.TRAINED_FILE if dst is None else dst
    state = {name: tensor.contiguous() for name, tensor in trained.items()}
    save_file(state, str(target), metadata={"digest": ocr.digest(size), "report": json.dumps(report)})
    return report


def main(args: list[str] | None = None) -> None:
    """``python -m kvlab.models.scaffolding.ocr_training [--train]``: print the shipped classifier's report,
    or train it again (about a minute on one core) and print the new one."""
    parser = argparse.ArgumentParser(description="smollm2-ocr's trained classifier: report or retrain.")
    parser.add_argument(
        "--train", action="store_true", help=f"train again and rewrite {ocr.TRAINED_FILE.name}"
    )
    ns = parser.parse_args(args)
    report = train() if ns.train else ocr.trained_report()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
