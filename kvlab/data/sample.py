"""The unit of data kvlab works on: one prompt (text plus optional images) and its references."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image


@dataclass
class Sample:
    """One prompt to run.

    Attributes:
        id: unique identifier within the dataset (predictions are keyed and resumed by it).
        prompt: the user's text. Images, if any, are placed before the text in the user turn.
        images: PIL images (already opened and converted to RGB).
        answers: reference answers (empty when the dataset has none).
        choices: options for multiple-choice questions (empty otherwise).
        system: optional system message.
        meta: free-form fields carried into the predictions file (e.g. needle position).
    """

    id: str
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
