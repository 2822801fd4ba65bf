"""Synthetic tasks with known answers, generated deterministically from a seed.

- ``synthetic_retrieval``: key-value "needle in a haystack" retrieval in text.
- ``synthetic_image_qa``: the colour of one region of generated 2x2 colour-grid images.

Each sample ``i`` is generated from its own ``random.Random(f"{seed}:{i}")`` so the same
parameters always give the same samples, on every platform and Python version.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.config.registry import context_field
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.tokens import ProcessorSource, check_tokenizer_name, fit_units, require_tokenizer

# --- text task -------------------------------------------------------------------------------
# Filler vocabulary: no digits and none of the key names or the words "secret"/"code", so the
# only 5-digit numbers and key names in a prompt are those of the inserted facts.
_SUBJECTS = (
    "The old fisherman", "A young painter", "The village baker", "Our neighbour", "The museum guide",
    "A travelling musician", "The librarian", "The gardener", "A curious student", "The ship captain",
    "The shopkeeper", "An elderly teacher", "The mayor", "A quiet poet", "The carpenter",
)  # fmt: skip
_VERBS = (
    "walked along", "painted", "described", "visited", "admired", "repaired", "photographed",
    "remembered", "sketched", "cleaned", "explored", "wrote about", "passed by", "talked about",
)  # fmt: skip
_OBJECTS = (
    "the quiet harbour", "the stone bridge", "the northern forest", "the crowded market",
    "the old lighthouse", "the narrow street", "the wooden fence", "the river bank", "the town hall",
    "the small chapel", "the apple orchard", "the railway station", "the windmill", "the garden wall",
)  # fmt: skip
_TAILS = (
    "before the rain began", "early in the morning", "with great care", "while humming a tune",
    "after a long winter", "on a windy afternoon", "without saying a word", "as the sun went down",
    "for the first time", "with a few friends", "during the summer fair", "late in the evening",
)  # fmt: skip
_KEYS = (
    "Juniper", "Falcon", "Marigold", "Orion", "Tamarind", "Zephyr", "Cobalt", "Saffron", "Nimbus",
    "Quartz", "Vesper", "Lotus", "Ember", "Argus", "Willow", "Cypress", "Indigo", "Halcyon", "Sable",
    "Topaz", "Borealis", "Kestrel", "Magnolia", "Obsidian", "Pippin", "Rosalind", "Sorrel", "Tundra",
    "Umber", "Yarrow",
)  # fmt: skip

# Word values: nouns that appear nowhere in the filler, the key names or the instructions.
_WORD_VALUES = (
    "lantern", "harvest", "compass", "velvet", "thunder", "pebble", "saddle", "meadow", "copper",
    "blossom", "anchor", "marble", "tunnel", "beacon", "candle", "glacier", "parrot", "violin",
    "walnut", "pepper", "canyon", "feather", "helmet", "island", "jacket", "kettle", "ladder",
    "mirror", "needle", "oyster",
)  # fmt: skip

MAX_PAIRS = len(_KEYS)
#: fewest tokens ``context_tokens`` may ask for (plus this per pair): no tokenizer kvlab knows
#: fits the instructions, the facts and the question in less
MIN_CONTEXT_TOKENS = 64
MIN_TOKENS_PER_PAIR = 16
#: what a fact calls its value, per value kind
_NOUNS = {"number": "code", "word": "word"}
_ANSWER_HINTS = {"number": "Answer with the 5-digit number only.", "word": "Answer with the word only."}


def filler_sentence(rng: random.Random) -> str:
    """One plausible filler sentence drawn from the fixed vocabulary."""
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def fact_sentence(key: str, value: str, noun: str = "code") -> str:
    """The sentence stating one key's value ("The secret code for Orion is 12345.")."""
    return f"The secret {noun} for {key} is {value}."


def check_num_samples(num_samples: int) -> None:
    """Shared range check of the synthetic tasks' ``num_samples``."""
    if num_samples < 1:
        raise ConfigError(
            f"num_samples must be >= 1, got {num_samples}. Set data.dataset.num_samples to a positive count."
        )


@DATASETS.register("synthetic_retrieval")
@dataclass
class SyntheticRetrieval:
    """Needle-in-a-haystack key-value retrieval in text (answer: a 5-digit number or a word).

    Each prompt is filler sentences with ``num_pairs`` facts "The secret code for <key> is
    <value>." inserted at sentence boundaries; the question, after the text, asks for one key
    (the needle), placed at relative depth ``needle_depth`` (0 = start, 1 = end), and is the
    sample's ``question`` (the context protocols and Finch's prefill split the prompt there). With
    ``needle_depth: null`` the depths are spread evenly over [0, 1] across the samples (in a
    seeded shuffled order). Length: ``context_words`` filler words, or, when ``context_tokens`` is
    set, the most filler sentences whose prompt takes at most ``context_tokens`` tokens of the
    ``tokenizer`` model (null: the run's ``model.model``), counted as the model sees the prompt
    (its chat template included; :mod:`kvlab.data.tokens`): one more sentence would
    exceed it, so a prompt falls short by less than one sentence (~10-30 tokens).
    ``value: word`` asks for "the secret word" (a common noun) instead of a 5-digit code.
    ``Sample.meta`` records ``key``, ``needle_depth`` (requested) and ``needle_word_fraction``
    (the share of context words before the needle), and ``prompt_tokens`` with ``context_tokens``.
    """

    num_samples: int = 8
    context_words: int = 400
    context_tokens: int | None = None
    num_pairs: int = 1
    needle_depth: float | None = None
    value: Literal["number", "word"] = "number"
    metrics: tuple[str, ...] = ("contains_answer", "exact_match")
    seed: int = 0
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)

    def __post_init__(self) -> None:
        check_num_samples(self.num_samples)
        self.metrics = check_metrics(self.metrics)
        if self.context_words < 1:
            raise ConfigError(
                f"context_words must be >= 1, got {self.context_words}. Set "
                f"data.dataset.context_words to the approximate prompt length in words."
            )
        least = MIN_CONTEXT_TOKENS + MIN_TOKENS_PER_PAIR * self.num_pairs
        if self.context_tokens is not None and self.context_tokens < least:
            raise ConfigError(
                f"context_tokens must be >= {least} with {self.num_pairs} pairs (no tokenizer fits the "
                f"instructions, facts and question in less), got {self.context_tokens}. Raise it, or set it "
                f"to null and use context_words."
            )
        pool = len(_WORD_VALUES) if self.value == "word" else MAX_PAIRS
        if not 1 <= self.num_pairs <= min(MAX_PAIRS, pool):
            raise ConfigError(
                f"num_pairs must be between 1 and {min(MAX_PAIRS, pool)} (one needle plus distractors), got "
                f"{self.num_pairs}. Fix data.dataset.num_pairs."
            )
        if self.needle_depth is not None and not 0.0 <= self.needle_depth <= 1.0:
            raise ConfigError(
                f"needle_depth must be in [0, 1] (0 = start of the context, 1 = end) or null to vary "
                f"it across samples, got {self.needle_depth}. Fix data.dataset.needle_depth."
            )
        check_tokenizer_name(self.tokenizer, self.processors)
        if self.context_tokens is not None and self.tokenizer is None:  # refuses, naming the fix
            require_tokenizer(None, self.processors, "synthetic_retrieval", "context_tokens")

    def depths(self) -> list[float]:
        """The needle depth of each sample."""
        if self.needle_depth is not None:
            return [float(self.needle_depth)] * self.num_samples
        n = self.num_samples
        depths = [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
        random.Random(f"{self.seed}:depths").shuffle(depths)
        return depths

    def samples(self) -> list[Sample]:
        """``num_samples`` retrieval prompts."""
        if self.context_tokens is None:
            return [self._sample(i, depth) for i, depth in enumerate(self.depths())]
        return [self._fitted_sample(i, depth) for i, depth in enumerate(self.depths())]

    def _fitted_sample(self, index: int, depth: float) -> Sample:
        """The sample with the most filler sentences whose prompt fits ``context_tokens``."""
        counter = require_tokenizer(self.tokenizer, self.processors, "synthetic_retrieval", "context_tokens")
        limit = int(self.context_tokens)  # type: ignore[arg-type]
        fitted = fit_units(
            lambda n: counter.count_prompt(self._sample(index, depth, n)), limit, max(1, limit // 16)
        )
        if fitted is None:
            shortest = counter.count_prompt(self._sample(index, depth, 1))
            raise ConfigError(
                f"data.dataset.context_tokens: {limit} tokens is too short for synthetic_retrieval with "
                f"{self.num_pairs} pairs and tokenizer {counter.name}: one filler sentence already makes "
                f"a {shortest}-token prompt. Raise context_tokens to at least {shortest}."
            )
        n, tokens = fitted
        sample = self._sample(index, depth, n)
        sample.meta["prompt_tokens"] = tokens
        return sample

    def _values(self, rng: random.Random) -> list[str]:
        if self.value == "word":
            return rng.sample(_WORD_VALUES, self.num_pairs)
        return [str(v) for v in rng.sample(range(10000, 100000), self.num_pairs)]

    def _sample(self, index: int, depth: float, sentences: int | None = None) -> Sample:
        """Sample ``index``: ``sentences`` filler sentences, or ``context_words`` words of them."""
        rng = random.Random(f"{self.seed}:{index}")
        filler: list[str] = []
        words = 0
        while len(filler) < sentences if sentences is not None else words < self.context_words:
            sentence = filler_sentence(rng)
            filler.append(sentence)
            words += len(sentence.split())
        keys = rng.sample(_KEYS, self.num_pairs)
        values = self._values(rng)
        noun = _NOUNS[self.value]
        slots = len(filler) + 1  # a fact goes before filler[slot] (slot == len(filler): at the end)
        needle_slot = round(depth * (slots - 1))
        others = [s for s in range(slots) if s != needle_slot] or [needle_slot]
        needle = fact_sentence(keys[0], values[0], noun)
        facts: dict[int, list[str]] = {needle_slot: [needle]}
        for key, value in zip(keys[1:], values[1:], strict=True):
            facts.setdefault(rng.choice(others), []).append(fact_sentence(key, value, noun))
        parts: list[str] = []
        for slot in range(slots):
            parts.extend(facts.get(slot, []))
            if slot < len(filler):
                parts.append(filler[slot])
        context = " ".join(parts)
        before = context[: context.index(needle)]
        question = f"What is the secret {noun} for {keys[0]}? {_ANSWER_HINTS[self.value]}"
        return Sample(
            id=f"retrieval-{index:04d}",
            prompt=f"Read the text below and answer the question after it.\n\n{context}\n\n{question}",
            question=question,
            answers=[values[0]],
            meta={
                "task": "synthetic_retrieval",
                "key": keys[0],
                "needle_depth": depth,
                "needle_word_fraction": round(len(before.split()) / len(context.split()), 4),
                "distractor_keys": keys[1:],
                "context_words": len(context.split()),
            },
        )


# --- image task ------------------------------------------------------------------------------
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (240, 220, 40),
    "purple": (140, 50, 180),
    "orange": (245, 140, 20),
}
REGIONS = ("top left", "top right", "bottom left", "bottom right")
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


def grid_image(colours: list[str], size: int) -> Image.Image:
    """A ``size`` x ``size`` RGB image: four solid regions coloured in :data:`REGIONS` order."""
    image = Image.new("RGB", (size, size))
    half = size // 2
    boxes = [(0, 0, half, half), (half, 0, size, half), (0, half, half, size), (half, half, size, size)]
    for colour, box in zip(colours, boxes, strict=True):
        image.paste(PALETTE[colour], box)
    return image


def region_pixel(region: str, size: int) -> tuple[int, int]:
    """The (x, y) centre pixel of a named region in a ``size`` x ``size`` grid image."""
    half = size // 2
    col = 1 if region.endswith("right") else 0
    row = 1 if region.startswith("bottom") else 0
    x0, x1 = (0, half) if col == 0 else (half, size)
    y0, y1 = (0, half) if row == 0 else (half, size)
    return (x0 + x1) // 2, (y0 + y1) // 2


@DATASETS.register("synthetic_image_qa")
@dataclass
class SyntheticImageQA:
    """Colour of one region of generated 2x2 colour-grid images (multiple choice).

    Each image has four solid regions (top left, top right, bottom left, bottom right) with
    distinct colours from :data:`PALETTE`. The question names a region (and, with
    ``images_per_sample > 1``, which image: "In the second image, ..."); the answer is the colour
    name and ``choices`` are all palette colours. ``Sample.meta`` records the asked
    ``image_index`` and ``region`` and every image's ``grids`` (colours in region order).
    """

    num_samples: int = 8
    image_size: int = 56
    images_per_sample: int = 1
    metrics: tuple[str, ...] = ("exact_match", "choice_accuracy")
    seed: int = 0

    def __post_init__(self) -> None:
        check_num_samples(self.num_samples)
        self.metrics = check_metrics(self.metrics)
        if not 2 <= self.image_size <= 4096:
            raise ConfigError(
                f"image_size must be between 2 and 4096 pixels, got {self.image_size}. Fix "
                f"data.dataset.image_size."
            )
        if not 1 <= self.images_per_sample <= len(_ORDINALS):
            raise ConfigError(
                f"images_per_sample must be between 1 and {len(_ORDINALS)}, got "
                f"{self.images_per_sample}. Fix data.dataset.images_per_sample."
            )

    def samples(self) -> list[Sample]:
        """``num_samples`` image questions."""
        return [self._sample(i) for i in range(self.num_samples)]

    def _sample(self, index: int) -> Sample:
        rng = random.Random(f"{self.seed}:{index}")
        names = list(PALETTE)
        grids = [rng.sample(names, len(REGIONS)) for _ in range(self.images_per_sample)]
        image_index = rng.randrange(self.images_per_sample)
        region_index = rng.randrange(len(REGIONS))
        region = REGIONS[region_index]
        options = ", ".join(names[:-1]) + f" or {names[-1]}"
        if self.images_per_sample == 1:
            question = f"What colour is the {region} region of the image?"
        else:
            question = f"In the {_ORDINALS[image_index]} image, what colour is the {region} region?"
        return Sample(
            id=f"image_qa-{index:04d}",
            prompt=f"{question} Answer with one word: {options}.",
            images=[grid_image(grid, self.image_size) for grid in grids],
            answers=[grids[image_index][region_index]],
            choices=names,
            meta={
                "task": "synthetic_image_qa",
                "image_index": image_index,
                "region": region,
                "grids": grids,
            },
        )
