"""kvlab's :class:`~kvlab.models.base.Processor`: templated prompts, image expansion, left-padded batches.

One :class:`ChatProcessor` serves every model. What differs between vision-language families is
how images become pixels and what text one image's placeholder becomes; that lives in an image
adapter (:mod:`kvlab.models.images`).

The prompt format is chosen by ``data.chat_template`` (:data:`CHAT_TEMPLATE_MODES` or a path):

- ``auto`` (default): the tokenizer's own chat template when it has one, rendered with
  ``add_generation_prompt=True`` and tokenized without adding special tokens (the ids equal
  ``apply_chat_template(..., tokenize=True)``, so a template that writes BOS gets exactly one);
  without a template, the prompt is passed raw and tokenized with the tokenizer's own special
  tokens (BOS as ``tokenizer(prompt)`` adds it), as transformers' pipelines do. kvlab never
  invents a template.
- ``none``: always the raw prompt, with the tokenizer's special tokens.
- a path to a ``.jinja`` file: that Jinja chat template instead of the tokenizer's.

A raw prompt with a system message is ``{system}\\n\\n{prompt}``. A vision-language model needs a
template (it places the image tokens): without one it is refused (:meth:`ChatProcessor.check_template`).

With kvlab's built-in models (ChatML) a prompt reads::

    [system turn] <|im_start|>user\\n<image 1>...<image n>{prompt}<|im_end|>\\n<|im_start|>assistant\\n

The template renders each image as one placeholder (the image token, plus wrappers such as
``<|vision_start|>``); the processor then replaces it with the image's text: the image token
repeated as many times as the image's vision features need, or, for
:class:`~kvlab.models.images.FamilyImages`, the text the family's transformers processor writes
(tile tags, newlines and begin/end markers around the image tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.models.base import IMAGE, PAD, TEXT, VIDEO, Batch
from kvlab.models.images import ImageAdapter, ProcessedImages

CHATML_END = "<|im_end|>"
#: the named values of ``data.chat_template`` (anything else is a path to a Jinja template file)
CHAT_TEMPLATE_MODES = ("auto", "none")
#: marks where the question starts when the chat template is rendered (private-use characters,
#: never in a prompt)
QUESTION_MARK = "\ue000kvlab-question\ue000"


def read_chat_template(chat_template: str) -> str | None:
    """The Jinja text ``data.chat_template`` names: None for ``auto``/``none``, the file's text for a path.

    Raises:
        ConfigError: the path is not a readable file.
    """
    if chat_template in CHAT_TEMPLATE_MODES:
        return None
    path = Path(str(chat_template)).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.chat_template must be auto, none or the path of a Jinja chat template file, got "
            f"{chat_template!r}, which is not an existing file. Use `auto` (the model's own template, or "
            "the raw prompt when it has none), `none` (always the raw prompt) or fix the path."
        )
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"data.chat_template: cannot read the chat template file {str(path)!r} ({exc}). Check its "
            "permissions and that it is a UTF-8 Jinja text file."
        ) from None


class ChatProcessor:
    """The kvlab processor for every model (implements :class:`kvlab.models.base.Processor`).

    Args:
        tokenizer: an HF tokenizer; its chat template (if any) accepts string content and, for
            VLMs, list content with ``{"type": "image"}`` entries.
        image_token_ids / video_token_ids: from the model config (modality 1 / 2).
        images: how to turn images into inputs; None for text-only models.
        extra_eos_token_ids: more ids that end generation (e.g. from the generation config).
        chat_template: ``auto``, ``none`` or the path of a Jinja template file (the module
            docstring says what each does); :meth:`with_chat_template` gives a copy with another.
    """

    def __init__(
        self,
        tokenizer: Any,
        image_token_ids: tuple[int, ...] = (),
        video_token_ids: tuple[int, ...] = (),
        images: ImageAdapter | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        chat_template: str = "auto",
    ):
        self.tokenizer = tokenizer
        self.chat_template = str(chat_template)
        self._file_template = read_chat_template(self.chat_template)
        self.image_token_ids = tuple(image_token_ids)
        self.video_token_ids = tuple(video_token_ids)
        self.images = images
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if self.pad_token_id is None:
            raise ConfigError(
                "the tokenizer has neither a pad nor an eos token; kvlab cannot left-pad batches"
            )
        eos = [tokenizer.get_vocab().get(CHATML_END), tokenizer.eos_token_id, *extra_eos_token_ids]
        self._eos_token_ids = list(dict.fromkeys(int(t) for t in eos if t is not None))
        self.image_token = (
            tokenizer.convert_ids_to_tokens(self.image_token_ids[0]) if image_token_ids else None
        )
        #: what the chat template writes for one image (replaced per image in :meth:`collate`)
        self.placeholder = (images.placeholder if images is not None else None) or self.image_token

    # ---- prompt building --------------------------------------------------------------------
    def with_chat_template(self, chat_template: str) -> ChatProcessor:
        """A shallow copy of this processor using ``chat_template`` (``auto``, ``none`` or a file path)."""
        out = copy.copy(self)
        out.chat_template = str(chat_template)
        out._file_template = read_chat_template(out.chat_template)
        return out

    @property
    def template(self) -> str | None:
        """The Jinja chat template in use, or None when prompts are passed raw."""
        if self._file_template is not None:
            return self._file_template
        if self.chat_template == "none":
            return None
        return getattr(self.tokenizer, "chat_template", None) or None

    def check_template(self) -> None:
        """Refuse a vision-language model without a chat template (nothing would place its images).

        Raises:
            ConfigError: naming ``data.chat_template`` and the fix.
        """
        if self.images is None or self.template is not None:
            return
        why = (
            "data.chat_template is `none`"
            if self.chat_template == "none"
            else "its tokenizer has no chat template (nor a chat_template.jinja/.json next to it)"
        )
        raise ConfigError(
            f"this vision-language model cannot be prompted: {why}, and kvlab does not guess a VLM's "
            "prompt format (where its image tokens go). Set `data.chat_template` to the path of the "
            "model family's Jinja chat template (one that renders {'type': 'image'} entries), or use a "
            "built-in VLM (tiny-qwen2-vl, tiny-llava, smollm2-qwen2-vl, smollm2-llava), which ship theirs."
        )

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        """ChatML messages: optional system turn, then the user turn (images first, then the text)."""
        msgs: list[dict[str, Any]] = []
        if sample.system is not None:
            msgs.append({"role": "system", "content": sample.system})
        if sample.images:
            content: Any = [{"type": "image"} for _ in sample.images] + [
                {"type": "text", "text": sample.prompt}
            ]
        else:
            content = sample.prompt  # plain string: works with text-only templates too
        msgs.append({"role": "user", "content": content})
        return msgs

    def prompt_text(self, sample: Sample) -> str:
        """The prompt as text: chat-templated (one image token per image, before expansion), or raw
        (``{system}\\n\\n{prompt}`` with a system message) when no template is in use.

        A sample's ``answer_prefix`` starts the assistant's turn: it follows the template's
        assistant opening, or, raw, the prompt after a newline (kvpress' ``question + "\\n" +
        answer_prefix`` for models without a chat template)."""
        self.check_template()
        if self.template is None:
            text = sample.prompt if sample.system is None else f"{sample.system}\n\n{sample.prompt}"
            return text + (f"\n{sample.answer_prefix}" if sample.answer_prefix else "")
        return self._render(sample) + sample.answer_prefix

    def _render(self, sample: Sample) -> str:
        """``sample``'s messages through the chat template, assistant turn opened (no answer prefix)."""
        return self.tokenizer.apply_chat_template(
            self.messages(sample),
            add_generation_prompt=True,
            tokenize=False,
            chat_template=self._file_template,
        )

    def context_token_count(self, sample: Sample, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` are ``sample``'s context; the rest is its question part.

        ``ids``: the sample's prompt ids as :meth:`collate` builds them (chat template, images
        expanded, answer prefix). The context is the prompt's text up to ``sample.question``
        (``sample.context``: the whole user text when the sample has no question), with the system
        turn, the images and the template's opening; the question part is the question, the
        template's end of the user turn and assistant opening, and the answer prefix: what the
        ``query_agnostic`` and ``multi_question`` protocols prefill after compressing the context
        (docs/protocols.md). The prompt is tokenized once, as a whole, so every protocol sees the
        same tokens; the split is the longest prefix of the ids that the context's own
        tokenization shares (a token merged across the boundary goes to the question part). With
        images (always before the text, so in the context, however the family expands them) the
        question part is measured on the prompt without its images and must end ``ids`` unchanged.

        Raises:
            ConfigError: the chat template does not render the user's text once, or the question
                part of the prompt without images differs from the real one.
        """
        if not sample.images:
            return _shared_prefix(ids, self.encode(self._context_text(sample)))
        bare = replace(sample, images=[])
        bare_ids = self.prompt_ids(bare)
        question = len(bare_ids) - _shared_prefix(bare_ids, self.encode(self._context_text(bare)))
        if question > len(ids) or list(ids[len(ids) - question :]) != bare_ids[len(bare_ids) - question :]:
            raise ConfigError(
                f"sample '{sample.id}': its question part tokenizes differently with and without its images, "
                "so kvlab cannot tell where the question starts (the query_agnostic and multi_question "
                "protocols prefill it after compressing the context). Use `model.protocol: query_aware` for "
                "this model, or report the model family to kvlab."
            )
        return len(ids) - question

    def _context_text(self, sample: Sample) -> str:
        """The prompt text before ``sample``'s question (images not expanded): the template rendered
        with a marker between context and question, cut at the marker. Only a guide for
        :meth:`context_token_count`, which keeps the prefix of the real ids it shares (a template
        that trims the user text just moves the split a few tokens earlier)."""
        if self.template is None:
            return sample.context if sample.system is None else f"{sample.system}\n\n{sample.context}"
        text = f"{sample.context}{QUESTION_MARK}{sample.question or ''}"
        rendered = self._render(replace(sample, prompt=text, question=None))
        if rendered.count(QUESTION_MARK) != 1:
            raise ConfigError(
                f"sample '{sample.id}': the chat template does not render the user's text once, verbatim, so "
                "kvlab cannot tell where its question starts (the query_agnostic and multi_question "
                "protocols prefill the question after compressing the context). Use `data.chat_template: "
                "none` or a template that writes the user content once, or `model.protocol: query_aware`."
            )
        return rendered[: rendered.index(QUESTION_MARK)]

    def text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` inside a prompt: no special tokens added (a request to the model
        written into a prompt, KVzip's reconstruction)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def assistant_opening_ids(self) -> list[int]:
        """Token ids the prompt format writes after a user message's text up to the assistant's answer:
        the chat template rendered around a marker, what follows the marker (the end of the user
        turn and the assistant's opening); ``"\n"`` without a template (kvpress' ``KVzipPress``).

        Raises:
            ConfigError: the chat template does not render the user's text once, verbatim.
        """
        if self.template is None:
            return self.text_ids("\n")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION_MARK}],
            add_generation_prompt=True,
            tokenize=False,
            chat_template=self._file_template,
        )
        if rendered.count(QUESTION_MARK) != 1:
            raise ConfigError(
                "the chat template does not render the user's text once, verbatim, so kvlab cannot tell "
                "what it writes after a user message (the reconstruct prefill, KVzip, asks the model to "
                "repeat the prompt in a user turn). Use `data.chat_template: none` or a template that "
                "writes the user content once."
            )
        return self.text_ids(rendered[rendered.index(QUESTION_MARK) + len(QUESTION_MARK) :])

    def encode(self, text: str) -> list[int]:
        """Token ids of a :meth:`prompt_text` (images expanded): a templated prompt without added
        special tokens (as ``apply_chat_template(tokenize=True)``: the template writes any BOS), a
        raw prompt with the tokenizer's own (BOS as ``tokenizer(prompt)`` adds it)."""
        raw = self.template is None
        return list(self.tokenizer(text, add_special_tokens=raw)["input_ids"])

    def prompt_ids(self, sample: Sample) -> list[int]:
        """Token ids of a text-only ``sample``'s prompt, as :meth:`collate` builds them."""
        return self.encode(self.prompt_text(sample))

    def _expand(self, text: str, images: ProcessedImages, sample: Sample) -> str:
        """Replace the i-th image placeholder of ``text`` with image i's text (``images`` holds the
        sample's images only): ``images.texts[i]``, or the image token ``images.counts[i]`` times."""
        pieces = text.split(self.placeholder) if self.placeholder else [text]
        if len(pieces) - 1 != len(images.counts):
            raise ConfigError(
                f"sample '{sample.id}': the chat template rendered {len(pieces) - 1} image placeholders "
                f"({self.placeholder!r}) for {len(images.counts)} images; the prompt text must not contain "
                "the image token itself, and the tokenizer's chat template must render {'type': 'image'} "
                "entries."
            )
        texts = images.texts or [self.image_token * count for count in images.counts]  # type: ignore[operator]
        out = [pieces[0]]
        for image_text, piece in zip(texts, pieces[1:], strict=True):
            out.append(image_text + piece)
        return "".join(out)

    # ---- Processor protocol -----------------------------------------------------------------
    def collate(self, samples: list[Sample]) -> Batch:
        """Samples -> left-padded batch (B = len(samples), T = longest prompt).

        Returns a :class:`~kvlab.models.base.Batch`: ``input_ids`` [B, T], ``attention_mask``
        [B, T] (0 on padding), ``modality`` [B, T] (0 text, 1 image, 2 video, -1 padding),
        ``model_inputs`` (Qwen2-VL: ``pixel_values`` [patches, 1176], ``image_grid_thw`` [N, 3],
        ``mm_token_type_ids`` [B, T]; LLaVA: ``pixel_values`` [N, 3, H, W]; N = images in the
        batch, in sample order; empty for text-only batches except ``mm_token_type_ids``), ``ids``
        and ``samples``.
        """
        if not samples:
            raise ValueError("collate() needs at least one sample")
        all_images = [img for s in samples for img in s.images]
        if all_images and self.images is None:
            bad = next(s.id for s in samples if s.images)
            raise ConfigError(
                f"sample '{bad}' has images but the model is text-only; use a vision-language model "
                "(e.g. tiny-qwen2-vl, smollm2-qwen2-vl) or a text-only dataset."
            )
        processed = ProcessedImages({}, [])
        if all_images:
            processed = ProcessedImages(*self.images.process(all_images))  # type: ignore[union-attr]
        model_inputs: dict[str, Any] = dict(processed.inputs)
        counts = list(processed.counts)
        rows: list[list[int]] = []
        start = 0
        for sample in samples:
            n = len(sample.images)
            texts = processed.texts[start : start + n] if processed.texts is not None else None
            own = ProcessedImages({}, counts[start : start + n], texts)
            text = self._expand(self.prompt_text(sample), own, sample)
            start += n
            rows.append(self.encode(text))

        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                attention_mask[i, width - len(row) :] = 1

        image_ids = torch.tensor(self.image_token_ids, dtype=torch.long)
        video_ids = torch.tensor(self.video_token_ids, dtype=torch.long)
        modality = torch.full_like(input_ids, TEXT)
        modality[torch.isin(input_ids, image_ids)] = IMAGE
        modality[torch.isin(input_ids, video_ids)] = VIDEO
        modality[attention_mask == 0] = PAD
        if sum(counts) != int((modality == IMAGE).sum()):
            raise RuntimeError(f"expected {sum(counts)} image tokens, found {int((modality == IMAGE).sum())}")
        if self.images is not None:
            extra = self.images.batch_inputs(input_ids, image_ids, video_ids)
            for value in extra.values():
                value[attention_mask == 0] = 0
            model_inputs.update(extra)
        ids = [s.id for s in samples]
        return Batch(input_ids, attention_mask, modality, model_inputs, ids, list(samples))

    def decode(self, token_ids: list[int] | torch.Tensor) -> str:
        """Token ids -> text, special tokens (chat markers, image tokens, padding) skipped."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """``<|im_end|>`` (the ChatML turn end), the tokenizer's eos and any extra ids, deduplicated."""
        return list(self._eos_token_ids)

    def __repr__(self) -> str:
        kind = type(self.images).__name__ if self.images else "text"
        return (
            f"ChatProcessor({type(self.tokenizer).__name__}, vocab={len(self.tokenizer)}, images={kind}, "
            f"chat_template={self.chat_template!r})"
        )


def _shared_prefix(ids: Sequence[int], other: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        n += 1
    return n
