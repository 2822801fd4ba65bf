"""Prompts reach the model as it expects (``data.chat_template``), and a run shows the first one.

Tokenizers are built offline from kvlab's runtime-trained tiny BPE, wrapped with a BOS token, with
or without a chat template, and saved next to a tiny config as a local model directory.
"""

from collections.abc import Mapping
from pathlib import Path

import pytest
from support.tokenizers import BOS, bos_tokenizer

from kvlab.cli.main import main
from kvlab.cli.prompt_example import EXAMPLE_KEEP, describe_prompt, elide
from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.models import load_processor
from kvlab.models.scaffolding import tiny
from kvlab.runner.datamodule import KVLabDataModule

PROMPT = "Remember the passkey 4821. What is the passkey?"
# not ChatML, so that a ChatML prompt could not pass for the model's own format
INSTRUCT = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)
WITH_BOS = "{{ bos_token }}" + INSTRUCT


def model_dir(path: Path, chat_template: str | None = None, vlm: bool = False) -> Path:
    """A local model directory (config, tokenizer; for a VLM the image processor) without weights."""
    path.mkdir(parents=True)
    if vlm:
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        tiny.tiny_qwen2_vl_config().save_pretrained(path)
        Qwen2VLImageProcessorPil().save_pretrained(path)
    else:
        tiny.tiny_llama_config().save_pretrained(path)
    bos_tokenizer(chat_template).save_pretrained(path)
    return path


def chat_ids(tokenizer, chat_template: str | None = None) -> list[int]:
    """transformers' own ids of the one-turn conversation, assistant turn opened."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=True,
        chat_template=chat_template,
    )
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def processor_for(path: Path, chat_template: str = "auto"):
    """The processor a run uses: through the data module, as ``kvlab predict`` builds it."""
    data = KVLabDataModule(model=str(path), chat_template=chat_template, dataset=None, limit=1)
    data.setup("predict")
    return data.processor


def batch_ids(processor) -> list[int]:
    return processor.collate([Sample("s", PROMPT)]).input_ids[0].tolist()


def test_base_model_gets_the_raw_prompt_with_one_bos(tmp_path):
    proc = processor_for(model_dir(tmp_path / "base"))
    tok = proc.tokenizer
    want = tok(PROMPT).input_ids
    assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    assert batch_ids(proc) == want
    assert proc.prompt_ids(Sample("s", PROMPT)) == want
    assert "<|im_start|>" not in proc.prompt_text(Sample("s", PROMPT))  # no invented ChatML


def test_instruct_model_gets_its_own_template(tmp_path):
    proc = processor_for(model_dir(tmp_path / "instruct", INSTRUCT))
    want = chat_ids(proc.tokenizer)
    assert batch_ids(proc) == want
    assert proc.tokenizer.bos_token_id not in want  # this template writes no BOS, tokenization adds none
    assert proc.prompt_text(Sample("s", PROMPT)).endswith("[assistant]: ")


def test_template_that_writes_bos_gets_exactly_one(tmp_path):
    proc = processor_for(model_dir(tmp_path / "bos", WITH_BOS))
    bos = proc.tokenizer.bos_token_id
    ids = batch_ids(proc)
    assert ids == chat_ids(proc.tokenizer)
    assert ids[0] == bos and ids.count(bos) == 1


def test_none_passes_the_prompt_raw_even_with_a_template(tmp_path):
    proc = processor_for(model_dir(tmp_path / "instruct", INSTRUCT), "none")
    assert batch_ids(proc) == proc.tokenizer(PROMPT).input_ids
    assert proc.prompt_text(Sample("s", PROMPT, system="Be brief.")) == f"Be brief.\n\n{PROMPT}"


def test_jinja_file_replaces_the_tokenizers_template(tmp_path):
    path = model_dir(tmp_path / "instruct", INSTRUCT)
    template = tmp_path / "mine.jinja"
    template.write_text("{{ bos_token }}QUESTION: {{ messages[-1]['content'] }}\nANSWER:")
    proc = processor_for(path, str(template))
    assert proc.prompt_text(Sample("s", PROMPT)) == f"{BOS}QUESTION: {PROMPT}\nANSWER:"
    ids = batch_ids(proc)
    assert ids == chat_ids(proc.tokenizer, template.read_text())
    assert ids.count(proc.tokenizer.bos_token_id) == 1


def test_missing_template_file_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="data.chat_template"):
        KVLabDataModule(model="tiny-llama", chat_template=str(tmp_path / "nope.jinja"))


def test_vlm_without_a_template_is_refused(tmp_path):
    path = model_dir(tmp_path / "vlm", vlm=True)
    with pytest.raises(ConfigError, match="data.chat_template"):
        processor_for(path)
    with pytest.raises(ConfigError, match="data.chat_template"):
        processor_for(path, "none")
    template = tmp_path / "vlm.jinja"
    template.write_text(
        "{% for m in messages %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    proc = processor_for(path, str(template))  # with the family's template given, it is accepted
    from PIL import Image

    text = proc.prompt_text(Sample("s", "Describe.", images=[Image.new("RGB", (56, 56))]))
    assert text == "<|vision_start|><|image_pad|><|vision_end|>Describe."


def test_builtin_models_keep_their_chatml_templates():
    for name in ("tiny-llama", "tiny-qwen2-vl"):
        proc = KVLabDataModule(model=name, limit=1)
        proc.setup("predict")
        assert (
            proc.processor.prompt_text(Sample("s", "x"))
            == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
        )
    assert load_processor("tiny-llama").chat_template == "auto"


def test_describe_prompt_keeps_start_and_end_and_counts_tokens(tmp_path):
    proc = processor_for(model_dir(tmp_path / "base"))
    long = Sample("s", "start " + "filler " * 200 + "the end")
    text, n_tokens = describe_prompt(proc, long)
    assert n_tokens == len(proc.tokenizer(long.prompt).input_ids)
    assert text.startswith(f"{BOS}start filler") and text.endswith("filler the end")
    assert "characters elided" in text and len(text) < 2 * EXAMPLE_KEEP + 60
    assert elide("short") == "short"


def test_predict_shows_and_writes_the_first_prompt(tmp_path, capsys):
    main(
        [
            "predict",
            "--config",
            "full",
            "--model.model",
            "tiny-llama",
            "--model.max_new_tokens",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--data.limit",
            "1",
            "--run.dir",
            str(tmp_path / "runs"),
            "--run.experiment",
            "exp",
            "--run.method",
            "full",
        ]
    )
    run = tmp_path / "runs" / "exp" / "full"
    example = (run / "prompt_example.txt").read_text()
    assert "<|im_start|>user\n" in example and example.endswith("<|im_start|>assistant\n\n")
    assert "characters elided" in example
    out = capsys.readouterr().out
    first = example.splitlines()[0]
    assert first in out and " tokens, data.chat_template = auto)" in first
    assert '"chat_template": "auto"' in (run / "run.json").read_text()
