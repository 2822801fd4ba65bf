"""Tests for kvlab.data: datasets (jsonl + synthetic) and the data module, with a fake processor."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from support.cli import write_jsonl

import kvlab.models
from kvlab.config.errors import ConfigError
from kvlab.data import (
    DATASETS,
    PALETTE,
    REGIONS,
    JsonlDataset,
    Sample,
    SyntheticImageQA,
    SyntheticRetrieval,
)
from kvlab.data.synthetic import region_pixel
from kvlab.metrics.tasks import validate_task_metrics
from kvlab.models.base import IMAGE, PAD, TEXT, Batch
from kvlab.runner.datamodule import KVLabDataModule

# ---------------------------------------------------------------------------------------------
# fake processor: whitespace "tokenizer", each image -> 4 image tokens, left padding


class FakeProcessor:
    """Minimal Processor: words get ids on first sight; id 1 is the image token, 0 is padding."""

    IMAGE_TOKEN = 1

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<pad>": 0, "<image>": 1, "<eos>": 2}
        self.calls = 0

    def _tok(self, word: str) -> int:
        return self.vocab.setdefault(word, len(self.vocab))

    def collate(self, samples: list[Sample]) -> dict[str, Any]:
        self.calls += 1
        seqs = []
        for s in samples:
            ids = [self.IMAGE_TOKEN] * (4 * len(s.images)) + [self._tok(w) for w in s.prompt.split()]
            seqs.append(ids)
        width = max(len(ids) for ids in seqs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        modality = torch.full_like(input_ids, PAD)
        for row, ids in enumerate(seqs):
            t = torch.tensor(ids)
            input_ids[row, width - len(ids) :] = t
            mask[row, width - len(ids) :] = 1
            modality[row, width - len(ids) :] = torch.where(t == self.IMAGE_TOKEN, IMAGE, TEXT)
        return Batch(input_ids, mask, modality, {}, [s.id for s in samples], samples)

    def decode(self, token_ids: list[int]) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return " ".join(inverse[i] for i in token_ids if i > 2)

    @property
    def eos_token_ids(self) -> list[int]:
        return [2]


@pytest.fixture
def fake_models(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The data module's processor source (names checked, processors loaded) replaced by a fake that
    records what it loads."""
    record: dict[str, Any] = {"loaded": [], "processor": FakeProcessor()}

    class FakeProcessors:
        def check(self, name: str) -> None:
            pass

        def load(self, name: str) -> FakeProcessor:
            record["loaded"].append(name)
            return record["processor"]

    monkeypatch.setattr(KVLabDataModule, "processors", FakeProcessors())
    return record


def _same(a: list[Sample], b: list[Sample]) -> bool:
    def key(s: Sample) -> tuple:
        return (s.id, s.prompt, s.answers, s.choices, s.meta, [im.tobytes() for im in s.images])

    return [key(s) for s in a] == [key(s) for s in b]


# ---------------------------------------------------------------------------------------------
# synthetic_retrieval


def test_retrieval_deterministic() -> None:
    a = DATASETS.build({"name": "synthetic_retrieval", "seed": 3}).samples()
    b = DATASETS.build({"name": "synthetic_retrieval", "seed": 3}).samples()
    c = DATASETS.build({"name": "synthetic_retrieval", "seed": 4}).samples()
    assert len(a) == 8 and _same(a, b)
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert len({s.id for s in a}) == 8


def test_retrieval_answer_is_the_needle_value_exactly_once() -> None:
    ds = SyntheticRetrieval(num_samples=6, num_pairs=5, context_words=200, seed=1)
    for s in ds.samples():
        (answer,) = s.answers
        key = s.meta["key"]
        assert re.fullmatch(r"\d{5}", answer)
        assert s.prompt.count(answer) == 1
        assert f"The secret code for {key} is {answer}." in s.prompt
        assert s.prompt.rstrip().endswith("Answer with the 5-digit number only.")
        assert f"secret code for {key}?" in s.prompt  # the question asks for the needle's key
        assert s.prompt.count("The secret code for") == 5
        assert len(set(re.findall(r"\b\d{5}\b", s.prompt))) == 5  # distinct values
        assert s.prompt.count(key) == 2  # fact + question
        assert s.meta["distractor_keys"] and key not in s.meta["distractor_keys"]


def test_retrieval_marks_its_question() -> None:
    """The question is the sample's ``question``: query_agnostic compresses the text without it, and
    Finch's progressive prefill scores the chunks with it (not with the chat template's tail)."""
    processor = kvlab.models.load_processor("tiny-qwen2")
    for s in SyntheticRetrieval(num_samples=3, num_pairs=3, context_words=120, seed=2).samples():
        assert s.question is not None and s.question.startswith("What is the secret code for")
        assert s.prompt == s.context + s.question and s.answers[0] in s.context
        assert s.context.count(s.meta["key"]) == 1  # the fact only; the question is not context
        ids = processor.prompt_ids(s)
        question = processor.tokenizer.decode(ids[processor.context_token_count(s, ids) :])
        assert question.lstrip().startswith(f"What is the secret code for {s.meta['key']}?")


def test_retrieval_needle_depth() -> None:
    start = SyntheticRetrieval(num_samples=2, needle_depth=0.0).samples()
    end = SyntheticRetrieval(num_samples=2, needle_depth=1.0).samples()
    mid = SyntheticRetrieval(num_samples=2, needle_depth=0.5).samples()
    assert all(s.meta["needle_depth"] == 0.0 and s.meta["needle_word_fraction"] < 0.1 for s in start)
    assert all(s.meta["needle_word_fraction"] > 0.9 for s in end)
    assert all(0.35 < s.meta["needle_word_fraction"] < 0.65 for s in mid)
    varied = SyntheticRetrieval(num_samples=5).samples()
    assert sorted(s.meta["needle_depth"] for s in varied) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_retrieval_length_grows_with_context_words() -> None:
    lengths = [
        len(SyntheticRetrieval(num_samples=1, context_words=n).samples()[0].prompt.split())
        for n in (50, 400, 2000)
    ]
    assert lengths[0] < lengths[1] < lengths[2]
    assert 2000 <= lengths[2] < 2200  # approximate control: filler + facts + question


def test_retrieval_context_tokens_with_smollm2_tokenizer() -> None:
    processor = kvlab.models.load_processor("smollm2-135m")  # tokenizer only (cached conversion)
    for tokens, pairs in ((512, 1), (2048, 4), (4096, 1)):
        samples = SyntheticRetrieval(
            num_samples=2,
            context_tokens=tokens,
            num_pairs=pairs,
            seed=7,
            tokenizer="smollm2-135m",
            processors=kvlab.models.PROCESSORS,
        ).samples()
        lengths = processor.collate(samples).attention_mask.sum(dim=1).tolist()
        assert all(abs(n - tokens) <= 0.06 * tokens for n in lengths), (tokens, lengths)


def test_retrieval_word_values_and_defaults() -> None:
    default = SyntheticRetrieval()
    assert (default.num_pairs, default.value, default.metrics) == (
        1,
        "number",
        ("contains_answer", "exact_match"),
    )
    for s in SyntheticRetrieval(num_samples=4, value="word", num_pairs=3, context_words=120).samples():
        (answer,) = s.answers
        assert answer.isalpha() and s.prompt.count(answer) == 1
        assert f"The secret word for {s.meta['key']} is {answer}." in s.prompt
        assert s.prompt.count("The secret word for") == 3 and not re.search(r"\d", s.prompt)
        assert s.prompt.endswith(f"What is the secret word for {s.meta['key']}? Answer with the word only.")


@pytest.mark.parametrize(
    ("param", "value"),
    [("needle_depth", 1.5), ("needle_depth", -0.1), ("num_pairs", 0), ("num_pairs", 1000),
     ("num_samples", 0), ("context_words", 0), ("context_tokens", 100), ("value", "colour")],
)  # fmt: skip
def test_retrieval_validation(param: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=param):
        DATASETS.build({"name": "synthetic_retrieval", param: value})


# ---------------------------------------------------------------------------------------------
# synthetic_image_qa


def test_image_qa_deterministic() -> None:
    a = DATASETS.build({"name": "synthetic_image_qa", "seed": 0, "images_per_sample": 2}).samples()
    b = DATASETS.build({"name": "synthetic_image_qa", "seed": 0, "images_per_sample": 2}).samples()
    c = DATASETS.build({"name": "synthetic_image_qa", "seed": 1, "images_per_sample": 2}).samples()
    assert _same(a, b)
    assert not _same(a, c)


@pytest.mark.parametrize("images_per_sample", [1, 3])
def test_image_qa_answer_is_region_colour(images_per_sample: int) -> None:
    size = 57  # odd on purpose
    ds = SyntheticImageQA(num_samples=12, image_size=size, images_per_sample=images_per_sample, seed=5)
    asked_regions = set()
    for s in ds.samples():
        assert len(s.images) == images_per_sample
        assert all(im.mode == "RGB" and im.size == (size, size) for im in s.images)
        assert s.choices == list(PALETTE)
        (answer,) = s.answers
        region, index = s.meta["region"], s.meta["image_index"]
        asked_regions.add(region)
        assert region in s.prompt and answer in s.choices
        if images_per_sample > 1:
            ordinal = ["first", "second", "third"][index]
            assert s.prompt.startswith(f"In the {ordinal} image, what colour is the {region} region?")
        assert s.images[index].getpixel(region_pixel(region, size)) == PALETTE[answer]
        # every region of every image is the solid colour recorded in meta
        for image, grid in zip(s.images, s.meta["grids"], strict=True):
            for reg, colour in zip(REGIONS, grid, strict=True):
                x, y = region_pixel(reg, size)
                assert image.getpixel((x, y)) == PALETTE[colour]
            corners = [(0, 0), (size - 1, 0), (0, size - 1), (size - 1, size - 1)]
            assert [image.getpixel(p) for p in corners] == [PALETTE[c] for c in grid]
    assert len(asked_regions) > 1


@pytest.mark.parametrize(
    ("param", "value"),
    [("image_size", 1), ("images_per_sample", 0), ("images_per_sample", 99), ("num_samples", 0)],
)
def test_image_qa_validation(param: str, value: int) -> None:
    with pytest.raises(ConfigError, match=param):
        DATASETS.build({"name": "synthetic_image_qa", param: value})


# ---------------------------------------------------------------------------------------------
# jsonl


def _png(path: Path, colour: tuple[int, int, int] = (10, 20, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), colour).save(path)
    return path


def test_jsonl_loads_samples(tmp_path: Path) -> None:
    _png(tmp_path / "img" / "a.png", (255, 0, 0))
    Image.new("L", (4, 4), 128).save(tmp_path / "img" / "gray.png")
    file = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"id": "q1", "prompt": "What colour?", "images": "img/a.png", "answers": "red", "extra": 7},
            "",
            {"id": 2, "prompt": "Two images", "images": ["img/a.png", str(tmp_path / "img" / "gray.png")],
             "answers": ["x", 3], "choices": ["a", "b"], "system": "Be brief."},
            {"prompt": "No id, no images"},
        ],
    )  # fmt: skip
    samples = DATASETS.build({"name": "jsonl", "path": str(file)}).samples()
    assert [s.id for s in samples] == ["q1", "2", "4"]  # missing id -> line number
    first, second, third = samples
    assert first.answers == ["red"] and first.meta == {"extra": 7}
    assert first.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert second.answers == ["x", "3"] and second.choices == ["a", "b"] and second.system == "Be brief."
    assert [im.mode for im in second.images] == ["RGB", "RGB"]
    assert third.images == [] and third.answers == [] and third.choices == []


def test_jsonl_custom_fields_and_image_root(tmp_path: Path) -> None:
    _png(tmp_path / "pics" / "b.png")
    (tmp_path / "sub").mkdir()
    row = {"key": "k", "question": "hi", "pics": ["b.png"], "gold": "yes", "opts": ["yes"]}
    file = write_jsonl(tmp_path / "sub" / "d.jsonl", [row])
    ds = JsonlDataset(
        path=str(file), text_field="question", id_field="key", images_field="pics",
        answers_field="gold", choices_field="opts", image_root=str(tmp_path / "pics"),
    )  # fmt: skip
    (s,) = ds.samples()
    assert (s.id, s.prompt, s.answers, s.choices, len(s.images)) == ("k", "hi", ["yes"], ["yes"], 1)


def test_jsonl_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as info:
        DATASETS.build({"name": "jsonl", "path": str(missing)})
    assert "data.dataset.path" in str(info.value) and str(missing.resolve()) in str(info.value)


def test_jsonl_malformed_line(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "ok"}, '{"id": "b", "prompt": '])
    with pytest.raises(ConfigError, match=re.escape(f"{file}:2: malformed JSON")):
        DATASETS.build({"name": "jsonl", "path": str(file)})
    write_jsonl(file, ["[1, 2]"])
    with pytest.raises(ConfigError, match=re.escape(f"{file}:1: expected a JSON object")):
        DATASETS.build({"name": "jsonl", "path": str(file)})


def test_jsonl_missing_text_field(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "ok"}, {"id": "b7", "question": "?"}])
    with pytest.raises(ConfigError) as info:
        DATASETS.build({"name": "jsonl", "path": str(file)})
    msg = str(info.value)
    assert f"{file}:2" in msg and "'b7'" in msg and "'prompt'" in msg and "text_field" in msg


def test_jsonl_duplicate_id(tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"}]
    file = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=r"d\.jsonl:3: duplicate id 'a' \(first used on line 1\)"):
        DATASETS.build({"name": "jsonl", "path": str(file)})


def test_jsonl_missing_image(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"id": "s9", "prompt": "p", "images": ["gone.png"]}])
    with pytest.raises(ConfigError) as info:
        DATASETS.build({"name": "jsonl", "path": str(file)})
    msg = str(info.value)
    assert "'s9'" in msg and str(tmp_path / "gone.png") in msg and "not found" in msg


def test_jsonl_corrupt_image(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    file = write_jsonl(tmp_path / "d.jsonl", [{"id": "s10", "prompt": "p", "images": "bad.png"}])
    with pytest.raises(ConfigError) as info:
        DATASETS.build({"name": "jsonl", "path": str(file)})
    msg = str(info.value)
    assert "'s10'" in msg and str(tmp_path / "bad.png") in msg and "cannot be opened" in msg


def test_jsonl_other_errors(tmp_path: Path) -> None:
    empty = write_jsonl(tmp_path / "e.jsonl", [""])
    with pytest.raises(ConfigError, match="contains no samples"):
        DATASETS.build({"name": "jsonl", "path": str(empty)})
    bad_answers = write_jsonl(tmp_path / "a.jsonl", [{"id": "z", "prompt": "p", "answers": {"x": 1}}])
    with pytest.raises(ConfigError, match="'z'.*'answers'"):
        DATASETS.build({"name": "jsonl", "path": str(bad_answers)})
    with pytest.raises(ConfigError, match="image_root"):
        DATASETS.build({"name": "jsonl", "path": str(bad_answers), "image_root": str(tmp_path / "no")})
    with pytest.raises(ConfigError, match="has no parameter 'paht'"):
        DATASETS.build({"name": "jsonl", "paht": "x"})


# ---------------------------------------------------------------------------------------------
# data module


def test_datamodule_default_and_batches(fake_models: dict[str, Any]) -> None:
    dm = KVLabDataModule(batch_size=3)
    assert len(dm.samples) == 8 and dm.samples[0].meta["task"] == "synthetic_retrieval"
    dm.setup("predict")
    assert fake_models["loaded"] == ["smollm2-135m"]
    batches = list(dm.predict_dataloader())
    assert [len(b.ids) for b in batches] == [3, 3, 2]
    assert [i for b in batches for i in b.ids] == [s.id for s in dm.samples]
    assert batches[0].input_ids.shape == batches[0].attention_mask.shape
    assert fake_models["processor"].calls == 3
    assert dm.hparams["batch_size"] == 3


def test_datamodule_images_through_collate(fake_models: dict[str, Any]) -> None:
    node = OmegaConf.create({"name": "synthetic_image_qa", "num_samples": 2, "images_per_sample": 2})
    dm = KVLabDataModule(dataset=node, model="fake-vlm", batch_size=2)
    dm.setup("predict")
    (batch,) = list(dm.predict_dataloader())
    assert fake_models["loaded"] == ["fake-vlm"]
    assert (batch.modality == IMAGE).sum(dim=1).tolist() == [8, 8]
    assert batch.samples[0].images[0].size == (56, 56)


def test_datamodule_limit_and_skip_ids(fake_models: dict[str, Any]) -> None:
    node = {"name": "synthetic_retrieval", "num_samples": 6, "context_words": 30}
    ids = [s.id for s in KVLabDataModule(node).samples]
    skip = frozenset({ids[0], ids[2], ids[5]})  # ids[5] is beyond the limit: no effect
    dm = KVLabDataModule(node, limit=4, skip_ids=skip)
    assert len(ids) == 6 and [s.id for s in dm.selected_samples] == ids[:4]
    assert [s.id for s in dm.pending_samples()] == [ids[1], ids[3]]
    dm.setup("predict")
    got = [i for b in dm.predict_dataloader() for i in b.ids]
    assert got == [ids[1], ids[3]]
    done = KVLabDataModule(node, limit=4, skip_ids=frozenset(ids))
    done.setup("predict")
    assert list(done.predict_dataloader()) == []


def test_datamodule_errors_before_model_load(tmp_path: Path, fake_models: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="data.dataset.path"):
        KVLabDataModule({"name": "jsonl", "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ConfigError, match="Unknown dataset 'synthetic_retreival'"):
        KVLabDataModule({"name": "synthetic_retreival"})
    with pytest.raises(ConfigError, match="data.batch_size"):
        KVLabDataModule(batch_size=0)
    with pytest.raises(ConfigError, match="data.limit"):
        KVLabDataModule(limit=0)
    with pytest.raises(ConfigError, match="data.num_workers"):
        KVLabDataModule(num_workers=-1)
    assert fake_models["loaded"] == []


def test_datasets_keep_their_metric_names_which_the_task_registry_checks(tmp_path: Path) -> None:
    """Data sits below the metrics: a dataset keeps the names as strings (refusing only an empty
    list or a non-name); the registry refuses an unknown one (the run calls it before any model
    loads: tests/cli/test_bad_inputs.py)."""
    file = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "p", "answers": "x"}])
    jsonl = DATASETS.build({"name": "jsonl", "path": str(file), "metrics": ["token_f1"]})
    assert jsonl.metrics == ("token_f1",)
    for name in ("synthetic_retrieval", "synthetic_image_qa"):
        assert DATASETS.build({"name": name, "metrics": ["rouge_l"]}).metrics == ("rouge_l",)
        unknown = DATASETS.build({"name": name, "metrics": ["f1"]})
        with pytest.raises(ConfigError, match="unknown task metric 'f1'"):
            validate_task_metrics(unknown.metrics)
        with pytest.raises(ConfigError, match="data.dataset.metrics is empty"):
            DATASETS.build({"name": name, "metrics": []})
