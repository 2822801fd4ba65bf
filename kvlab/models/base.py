"""What kvlab needs to know about a loaded model, independent of its family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from kvlab.data.sample import Sample
from kvlab.data.tokens import PromptTokens

# modality ids carried per token in every batch
TEXT, IMAGE, VIDEO, PAD = 0, 1, 2, -1


@dataclass(frozen=True)
class ModelInfo:
    """Shapes and special tokens of a model's *language* model (the part kvlab compresses).

    Attributes:
        name: the name the user gave (built-in name, Hub id or directory).
        num_layers / num_heads / num_kv_heads / head_dim: of the language model.
        image_token_ids: token ids marking image positions (modality 1), from the model config.
        video_token_ids: token ids marking video positions (modality 2).
        vision_language: whether the model takes images.
        max_position_embeddings: context limit of the language model.
        bidirectional_image_blocks: the language model lets the tokens of one image (a run of
            consecutive image tokens) attend to each other in both directions (Gemma 3; from the
            family, :data:`kvlab.models.vlm.BIDIRECTIONAL_IMAGE_FAMILIES`); kvlab's prefill
            attention then applies those blocks.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    image_token_ids: tuple[int, ...] = ()
    video_token_ids: tuple[int, ...] = ()
    vision_language: bool = False
    max_position_embeddings: int = 8192
    bidirectional_image_blocks: bool = False

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size G = H / Hkv)."""
        return self.num_heads // self.num_kv_heads


@dataclass
class Batch:
    """A left-padded batch of B prompts, T tokens the longest (what ``collate`` returns).

    Attributes:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` long, 0 on padding.
        modality: ``[B, T]`` long: 0 text, 1 image, 2 video, -1 padding, found from the model
            config's special token ids (never from span lengths).
        model_inputs: extra ``forward()`` keyword arguments (``pixel_values``,
            ``image_grid_thw``, ``mm_token_type_ids``, ...); empty for text-only models.
        ids: the samples' ids.
        samples: the samples (empty for token-id prompts).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    modality: torch.Tensor
    model_inputs: dict[str, Any] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


@runtime_checkable
class Processor(Protocol):
    """Turns samples into a padded model batch, and token ids back into text: all a run needs of
    a processor. A processor that also builds prompts from text is a :class:`PromptProcessor`."""

    def collate(self, samples: list[Sample]) -> Batch:
        """Batch of samples -> :class:`Batch` (B = len(samples), T = longest prompt, left padded)."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        ...

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation."""
        ...


@runtime_checkable
class PromptProcessor(Processor, PromptTokens, Protocol):
    """A processor that builds each prompt from text through a tokenizer and a chat template
    (kvlab's :class:`~kvlab.models.processors.ChatProcessor`). What kvlab does only with one is
    asked with ``isinstance(processor, PromptProcessor)``: the data module's checks of prompt
    lengths, images and templates, splitting a prompt into context and question
    (``query_agnostic``, ``multi_question``), token-id and multi-turn prompts, the prompt example.

    Attributes:
        tokenizer: the Hugging Face tokenizer.
        pad_token_id: the id batches are left-padded with.
        images: the model's image adapter (:class:`~kvlab.models.images.ImageAdapter`); None for
            a text-only model.
        chat_template: ``auto``, ``none`` or the path of a template file (``data.chat_template``).
    """

    tokenizer: Any
    pad_token_id: int
    images: Any
    chat_template: str

    @property
    def template(self) -> str | None:
        """The chat template in use (the tokenizer's or a file's); None: the raw prompt."""
        ...

    def with_chat_template(self, chat_template: str) -> PromptProcessor:
        """A copy that formats prompts with ``chat_template``."""
        ...

    def check_template(self) -> None:
        """Refuse a template this processor cannot use (a VLM without one)."""
        ...

    def context_token_count(self, sample: Sample, ids: list[int]) -> int:
        """How many of ``ids`` (``sample``'s prompt) belong to its context, before the question."""
        ...

    def text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` inside a prompt (no special tokens added)."""
        ...

    def assistant_opening_ids(self) -> list[int]:
        """Token ids the prompt format writes after a user message's text to open the assistant's turn."""
        ...


@dataclass
class LoadedModel:
    """A model ready to run: the HF model (eval mode), its processor and its :class:`ModelInfo`, and
    where it came from.

    Attributes:
        source: ``builtin`` (``kvlab list``), ``pretrained`` (a directory or Hub id) or ``wrapped``
            (``kvlab.wrap_model``).
        path: where its weights live (a built-in's cache directory, the directory or the Hub id);
            None for a random or wrapped model.
        dtype: the dtype it was loaded in (a wrapped model's parameters' dtype).
        load_seconds: how long loading took (None when wrapped).
        image_size: built-in VLMs: the side of the square images they are built for.
        tokens_per_image: built-in VLMs: the image tokens one such image expands to.
        device_map: the resolved ``{module: device}`` when loaded with a ``device_map``.
    """

    model: torch.nn.Module
    processor: Processor
    info: ModelInfo
    source: Literal["builtin", "pretrained", "wrapped"] = "wrapped"
    path: str | None = None
    dtype: torch.dtype | None = None
    load_seconds: float | None = None
    image_size: int | None = None
    tokens_per_image: int | None = None
    device_map: dict[str, str] | None = None
