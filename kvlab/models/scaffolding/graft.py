"""Vision-language models whose language model is SmolLM2-135M-Instruct (grafted weights).

No trained VLM is available offline, so ``smollm2-qwen2-vl`` and ``smollm2-llava`` put SmolLM2's
trained weights into the text model of a VLM with a tiny *random* vision tower and projector.
Image embeddings are therefore noise, but the LM attending to them is trained, which is what
image-aware KV compression needs. Text-only logits equal SmolLM2's exactly (over its 49152
ids): the extra vision tokens get the mean embedding, Qwen2's q/k/v biases are zeroed, and
M-RoPE with ``mrope_section=[16, 8, 8]`` reduces to plain RoPE when all three position
streams are equal (text).

Both grafted models use 36 image tokens per image (Qwen2-VL: 168x168 -> 12x12 patches merged
2x2; LLaVA: 84x84 -> 6x6 patches).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer, LlavaConfig
from transformers.initialization import no_init_weights

from kvlab.models.common import seeded
from kvlab.models.scaffolding import smollm2
from kvlab.models.scaffolding.tokenizer import IMAGE_PLACEHOLDERS, VISION_TOKENS, add_vision_tokens

GRAFT_QWEN2VL_IMAGE = 168
GRAFT_LLAVA_IMAGE = 84
SMOLLM2_MROPE_SECTION = [16, 8, 8]  # sums to head_dim / 2 = 32
#: the system turn SmolLM2's own chat template inserts when a conversation has none
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TEXT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@functools.cache
def vlm_tokenizer(family: str) -> Any:
    """SmolLM2's tokenizer + :data:`VISION_TOKENS` + a list-aware ChatML template (cached: do not mutate).

    Text without vision tokens renders and tokenizes exactly as with SmolLM2's own template
    (including its default system turn).
    """
    tokenizer = AutoTokenizer.from_pretrained(smollm2.ensure_converted())
    add_vision_tokens(tokenizer, IMAGE_PLACEHOLDERS[family], SMOLLM2_DEFAULT_SYSTEM)
    return tokenizer


def text_dims(tokenizer: Any) -> dict[str, Any]:
    """SmolLM2's language-model kwargs, with the vocabulary grown to the VLM tokenizer's size."""
    config = smollm2.load_config().to_dict()
    dims = {key: config[key] for key in _TEXT_KEYS if key in config}
    dims["vocab_size"] = len(tokenizer)
    return dims


def token_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the vision tokens in the grafted tokenizer."""
    return {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}


def single_token_ids(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """The token id of each text (what a reading VLM's glyphs show), each exactly one token.

    Raises:
        RuntimeError: a text that is not one token (the glyph set and the tokenizer disagree).
    """
    ids = []
    for text in texts:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise RuntimeError(
                f"a reading VLM's glyph shows {text!r}, which is {len(tokens)} tokens, not one"
            )
        ids.append(tokens[0])
    return ids


def cell_llava_config(tokenizer: Any, image_size: int, cell: int, **clip: Any) -> Any:
    """The ``LlavaConfig`` of a reading VLM (``smollm2-reader``, ``smollm2-ocr``): SmolLM2's text
    dimensions, a CLIP tower that cuts ``image_size`` px images into one patch per ``cell`` px cell
    (LLaVA's ``default`` strategy: the CLS token dropped, the last layer's output), LLaVA's GELU
    projector. ``clip``: the tower's other fields (width, layers, activation...)."""
    text = {**text_dims(tokenizer), "model_type": "llama"}
    vision = {"model_type": "clip_vision_model", "image_size": image_size, "patch_size": cell,
              "num_attention_heads": 1, **clip}  # fmt: skip
    return LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids(tokenizer)["<image>"],
        image_seq_length=(image_size // cell) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )


class SplitVocabHead(torch.nn.Linear):
    """Bias-free LM head that computes logits for ids ``< split`` and ``>= split`` as two matmuls.

    The logits over SmolLM2's own vocabulary then come from the same ``[49152, 576]`` matmul as
    in SmolLM2 and are bit-identical (one ``[49157, 576]`` matmul picks other BLAS kernels and
    differs by ~3e-5). ``weight`` stays the (tied) ``[vocab, hidden]`` parameter.
    """

    def __init__(self, weight: torch.nn.Parameter, split: int):
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.split = split

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> logits [..., vocab]."""
        base = torch.nn.functional.linear(hidden, self.weight[: self.split])
        extra = torch.nn.functional.linear(hidden, self.weight[self.split :])
        return torch.cat([base, extra], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, split={self.split}"


def build_grafted(model_cls: Any, config: Any, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """A ``model_cls`` VLM from ``config`` with SmolLM2 as its LM and a seeded random vision part.

    Only the vision tower and projector are randomly initialised (the 135M LM weights are
    loaded, not initialised twice), in float32, then the model is cast to ``dtype``. Every
    random draw is seeded: the construction too, because ``no_init_weights`` disables
    ``torch.nn.init`` but not the plain ``torch.randn`` some modules call in ``__init__``
    (CLIP's ``class_embedding``, which the generic ``_init_weights`` below leaves alone).
    """
    with seeded(seed + 1), no_init_weights():  # its own stream: the init below draws as before
        vlm = model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with seeded(seed):
        for name, child in vlm.model.named_children():
            if name != "language_model":
                for module in child.modules():
                    vlm._init_weights(module)
    graft_smollm2(vlm)
    return vlm.to(dtype).eval()


def graft_smollm2(vlm: torch.nn.Module) -> torch.nn.Module:
    """Copy SmolLM2's weights into ``vlm.model.language_model`` (in place; returns ``vlm``).

    Embedding rows past SmolLM2's 49152 (the vision tokens) get the mean embedding; weights the
    VLM has and SmolLM2 lacks must be q/k/v biases (Qwen2) and are zeroed. The LM head is tied.
    """
    lm = vlm.model.language_model
    state = {
        k.removeprefix("model."): v for k, v in smollm2.load_state_dict().items() if k.startswith("model.")
    }
    old = state["embed_tokens.weight"]  # [49152, hidden]
    new = torch.empty_like(lm.embed_tokens.weight, dtype=old.dtype)  # [vocab, hidden]
    new[: old.shape[0]] = old
    new[old.shape[0] :] = old.mean(0)
    state["embed_tokens.weight"] = new
    missing, unexpected = lm.load_state_dict(state, strict=False)
    biases = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
    if unexpected or any(not name.endswith(biases) for name in missing):
        raise RuntimeError(f"grafting SmolLM2 failed: missing {missing}, unexpected {unexpected}")
    params = dict(lm.named_parameters())
    with torch.no_grad():
        for name in missing:
            params[name].zero_()
    head = vlm.get_output_embeddings()
    if head.weight.data_ptr() != lm.embed_tokens.weight.data_ptr():
        vlm.tie_weights()
        head = vlm.get_output_embeddings()
        if head.weight.data_ptr() != lm.embed_tokens.weight.data_ptr():
            raise RuntimeError("the grafted VLM's lm_head is not tied to its embeddings")
    vlm.set_output_embeddings(SplitVocabHead(lm.embed_tokens.weight, split=old.shape[0]))
    return vlm
