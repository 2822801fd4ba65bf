"""Scene images for the OCR VLM ``smollm2-ocr``: large, mostly empty images with a few printed words.

An image is :data:`GRID` x :data:`GRID` cells of :data:`CELL` pixels (16 x 16 cells of 40 px:
640 x 640, 256 patches). Most cells hold no text: a tinted background with a gradient and paper
noise, striped or checked texture panels and small icons repeated over the image (the same shape
several times, each copy shifted by a pixel or two), so a method that merges or drops redundant
patches has something to find. A few cells hold one *glyph* each: a word of :data:`WORDS`, a
digit or a punctuation mark, printed in one of two fonts (:data:`FONTS`: Pillow's bitmap font, or
its bundled FreeType font at 9 to 12 px), in a dark ink of random grey or hue, shifted by up to
:data:`MAX_SHIFT` px in the cell. The patch of a text cell shows the whole glyph (every glyph
fits its cell with room for the shift), so a reader whose features do not depend on where the
ink sits in the patch reads it wherever it is printed.

:func:`render_scene` draws one image from the cells that carry text (every other cell is drawn
as background) and returns each cell's label: its glyph, or ``""`` for a background cell (the
:data:`BACKGROUND_TEXT` token the reader maps it to, :func:`cell_text`). Everything random is drawn from the
``random.Random`` passed in, so a scene is a function of its generator's seed.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

CELL = 40
GRID = 16
IMAGE_SIZE = CELL * GRID
CELLS_PER_IMAGE = GRID * GRID
#: the furthest a glyph moves from the centre of its cell, in pixels, each way
MAX_SHIFT = 4
FONTS = ("bitmap", "sans")
#: the FreeType font's pixel sizes (the "scale within a range")
SANS_SIZES = (9, 10, 11, 12)
BACKGROUND = ""
#: the token a background patch reads as: four spaces (one SmolLM2 token, as in indented code).
#: SmolLM2-135M reads hundreds of them in a row and still copies the code (8 of 12 scene_code
#: prompts of 4 images at full cache); after hundreds of single-space tokens, which its tokenizer
#: never produces (it merges runs of spaces), it copied 3 of the same 12
BACKGROUND_TEXT = "    "

#: no 6 and no 9: the reader's features are a power spectrum, which cannot tell a glyph from its
#: 180-degree rotation, and in both fonts a 6 is a 9 turned over; no full stop either (a dot of a
#: few pixels: most of its held-out patches were misread in the first build)
DIGITS = tuple("01234578")
PUNCTUATION = (":", "#")
#: the words a scene can print: each one SmolLM2 token with its leading space, at most 5 letters
#: (so that every one fits its cell with room to move)
WORDS = (
    "The", "is", "code", "room", "gate", "door", "key", "pin", "box", "card", "page", "line", "note", "file",
    "date", "time", "year", "day", "week", "city", "town", "road", "park", "shop", "bank", "hotel",
    "train", "bus", "car", "ship", "plane", "home", "farm", "field", "river", "lake", "sea", "hill",
    "tree", "wood", "stone", "sand", "snow", "rain", "wind", "sun", "moon", "star", "light", "fire",
    "water", "milk", "cake", "apple", "rice", "tea", "wine", "beer", "salt", "sugar", "fish",
    "bird", "dog", "cat", "horse", "cow", "lion", "bear", "wolf", "fox", "frog", "duck", "bee",
    "king", "child", "girl", "boy", "man", "team", "club", "ball", "song", "book", "story", "word",
    "name", "list", "table", "chair", "bed", "lamp", "clock", "glass", "cup", "plate", "bag",
    "coat", "shoe", "hat", "shirt", "ring", "gold", "iron", "paper", "price", "sale", "gift", "red",
    "blue", "black", "white", "pink", "gray", "small", "big", "long", "short", "tall", "old", "new",
    "quiet", "warm", "cold", "hot", "soft", "hard", "dark", "fast", "slow", "early", "late", "open",
    "north", "south", "east", "west", "left", "right", "first", "last", "next", "main", "ice",
    "egg", "oil", "art", "map", "pen", "net", "toy", "arm", "leg", "eye", "sky", "jam", "nut",
    "owl", "pig", "rat", "ant",
)  # fmt: skip
#: every glyph a cell can print, background first
GLYPHS: tuple[str, ...] = (BACKGROUND, *DIGITS, *PUNCTUATION, *WORDS)

ICONS = ("circle", "square", "triangle", "cross", "diamond")
TEXTURES = ("stripes", "checks", "dots")


def cell_text(glyph: str) -> str:
    """The text of the (single) SmolLM2 token a cell shows: ``" word"`` for a word, a digit or a
    punctuation mark as itself, :data:`BACKGROUND_TEXT` (four spaces) for a background cell."""
    if glyph == BACKGROUND:
        return BACKGROUND_TEXT
    return glyph if glyph in DIGITS or glyph in PUNCTUATION else " " + glyph


@functools.cache
def font(name: str, size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """``"bitmap"``: Pillow's built-in bitmap font (6 x 11 px a character, no anti-aliasing);
    ``"sans"``: Pillow's bundled FreeType font (Aileron) at ``size`` px, anti-aliased. Both ship
    with Pillow (>= 10.1), so every platform draws the same glyph shapes."""
    if name == "bitmap":
        return ImageFont.load_default_imagefont()
    return ImageFont.load_default(size=size)


@dataclass(frozen=True)
class Style:
    """How one glyph is printed: ``font`` of :data:`FONTS` at ``size`` px (the bitmap font has
    one size), ``ink`` RGB, shifted ``(dx, dy)`` px from the cell's centre."""

    font: str
    size: int
    ink: tuple[int, int, int]
    dx: int
    dy: int


def glyph_size(glyph: str, style_font: str, size: int) -> tuple[int, int]:
    """``(width, height)`` in pixels of ``glyph``'s ink box in that font."""
    left, top, right, bottom = font(style_font, size).getbbox(glyph)
    return right - left, bottom - top


def random_style(glyph: str, rng: random.Random) -> Style:
    """A random font, size, dark ink and shift for ``glyph``; the shift keeps the ink at least
    one pixel inside the cell."""
    name = rng.choice(FONTS)
    size = rng.choice(SANS_SIZES) if name == "sans" else 11
    width, height = glyph_size(glyph, name, size)
    room_x, room_y = (min(MAX_SHIFT, max(0, (CELL - side) // 2 - 1)) for side in (width, height))
    grey = rng.randrange(0, 90)
    ink = (grey, grey, grey) if rng.random() < 0.6 else tuple(rng.randrange(0, 120) for _ in range(3))
    return Style(name, size, ink, rng.randint(-room_x, room_x), rng.randint(-room_y, room_y))  # type: ignore[arg-type]


def _glyph_alpha(glyph: str, style: Style) -> np.ndarray:
    """``[CELL, CELL]`` ink coverage in ``[0, 1]`` of ``glyph`` printed in ``style``."""
    face = font(style.font, style.size)
    left, top, right, bottom = face.getbbox(glyph)
    canvas = Image.new("L", (CELL, CELL), 0)
    x = (CELL - (right - left)) // 2 - left + style.dx
    y = (CELL - (bottom - top)) // 2 - top + style.dy
    ImageDraw.Draw(canvas).text((x, y), glyph, font=face, fill=255)
    return np.asarray(canvas, dtype=np.float32) / 255.0


def _icon_alpha(icon: str, dx: int, dy: int, size: int) -> np.ndarray:
    """``[CELL, CELL]`` coverage of a small outlined shape centred in the cell, shifted."""
    canvas = Image.new("L", (CELL, CELL), 0)
    draw = ImageDraw.Draw(canvas)
    c, r = CELL // 2 + dx, size // 2
    left, top, right, bottom = c - r, CELL // 2 + dy - r, c + r, CELL // 2 + dy + r
    if icon == "circle":
        draw.ellipse((left, top, right, bottom), outline=255, width=2)
    elif icon == "square":
        draw.rectangle((left, top, right, bottom), outline=255, width=2)
    elif icon == "triangle":
        draw.polygon([(c, top), (right, bottom), (left, bottom)], outline=255, width=2)
    elif icon == "cross":
        draw.line((left, top, right, bottom), fill=255, width=2)
        draw.line((left, bottom, right, top), fill=255, width=2)
    else:  # diamond
        mid = (top + bottom) // 2
        draw.polygon([(c, top), (right, mid), (c, bottom), (left, mid)], outline=255, width=2)
    return np.asarray(canvas, dtype=np.float32) / 255.0


def _texture(kind: str, height: int, width: int, period: int, phase: int) -> np.ndarray:
    """``[height, width]`` pattern in ``[0, 1]``: stripes, checks or a dot grid."""
    y, x = np.mgrid[0:height, 0:width]
    if kind == "stripes":
        return (((x + y + phase) // period) % 2).astype(np.float32)
    if kind == "checks":
        return (((x + phase) // period + (y // period)) % 2).astype(np.float32)
    return (((x + phase) % period < 2) & (y % period < 2)).astype(np.float32)


def _background(rng: random.Random, noise: np.random.Generator) -> np.ndarray:
    """``[IMAGE_SIZE, IMAGE_SIZE, 3]`` float: a light tint, a linear gradient, paper noise."""
    tint = np.array([rng.randrange(200, 256) for _ in range(3)], dtype=np.float32)
    y, x = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) / np.float32(IMAGE_SIZE)
    angle, depth = rng.uniform(0, 2 * np.pi), rng.uniform(0, 30)
    ramp = depth * ((np.cos(angle) * x + np.sin(angle) * y) - 0.5)
    image = tint[None, None, :] + ramp[:, :, None]
    image += noise.standard_normal((IMAGE_SIZE, IMAGE_SIZE, 1), dtype=np.float32) * rng.uniform(0.0, 5.0)
    return image


@dataclass(frozen=True)
class Scene:
    """A rendered scene: the RGB ``image``, each cell's glyph (``labels``, ``""`` for background)
    and the font it was printed in (``fonts``, ``""`` for background), in reading order."""

    image: Image.Image
    labels: list[str]
    fonts: list[str]


def render_scene(text: Mapping[int, str], rng: random.Random) -> Scene:
    """One scene: ``text`` maps cell indices (row-major, ``0 <= i < CELLS_PER_IMAGE``) to glyphs
    of :data:`GLYPHS`; every other cell is background. Texture panels and repeated icons go
    only in cells without text and not next to one (so a text cell's patch holds its glyph on
    plain background).

    Returns:
        the :class:`Scene` (its image, each cell's glyph and font).

    Raises:
        ValueError: a cell index out of range or a glyph outside :data:`GLYPHS`.
    """
    bad = {i: g for i, g in text.items() if not 0 <= i < CELLS_PER_IMAGE or g not in _GLYPH_SET or g == ""}
    if bad:
        raise ValueError(f"scene cells must be 0..{CELLS_PER_IMAGE - 1} with a glyph of GLYPHS: {bad}")
    noise = np.random.default_rng(rng.getrandbits(63))
    image = _background(rng, noise)
    near_text = {
        (r + dr) * GRID + (c + dc)
        for i in text
        for r, c in [divmod(i, GRID)]
        for dr in (-1, 0, 1)
        for dc in (-1, 0, 1)
        if 0 <= r + dr < GRID and 0 <= c + dc < GRID
    }
    free = [i for i in range(CELLS_PER_IMAGE) if i not in near_text]
    for _ in range(rng.randrange(1, 4)):  # texture panels
        r0, c0 = rng.randrange(GRID), rng.randrange(GRID)
        cells = [(r, c) for r in range(r0, min(GRID, r0 + rng.randrange(2, 6)))
                 for c in range(c0, min(GRID, c0 + rng.randrange(2, 6))) if r * GRID + c in free]  # fmt: skip
        kind, period, phase = rng.choice(TEXTURES), rng.randrange(3, 9), rng.randrange(8)
        strength = rng.uniform(10, 45)
        for r, c in cells:
            pattern = _texture(kind, CELL, CELL, period, phase + c * CELL)
            image[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL] -= strength * pattern[:, :, None]
        free = [i for i in free if divmod(i, GRID) not in cells]
    icon, size = rng.choice(ICONS), rng.randrange(10, 22)
    colour = np.array([rng.randrange(0, 160) for _ in range(3)], dtype=np.float32)
    for i in rng.sample(free, min(len(free), rng.randrange(4, 16))):  # one icon, repeated
        alpha = _icon_alpha(icon, rng.randint(-2, 2), rng.randint(-2, 2), size)
        _paint(image, i, alpha, colour)
    labels, fonts = [BACKGROUND] * CELLS_PER_IMAGE, [""] * CELLS_PER_IMAGE
    for i, glyph in text.items():
        style = random_style(glyph, rng)
        _paint(image, i, _glyph_alpha(glyph, style), np.array(style.ink, dtype=np.float32))
        labels[i], fonts[i] = glyph, style.font
    pixels = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    return Scene(Image.fromarray(pixels, "RGB"), labels, fonts)


def _paint(image: np.ndarray, cell: int, alpha: np.ndarray, colour: np.ndarray) -> None:
    """Blend ``colour`` into ``cell`` of ``image`` (in place) with coverage ``alpha``."""
    r, c = divmod(cell, GRID)
    block = image[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL]
    block[:] = block * (1 - alpha[:, :, None]) + colour[None, None, :] * alpha[:, :, None]


_GLYPH_SET = frozenset(GLYPHS)
