"""Images of text for the reading VLM ``smollm2-reader``: a grid of cells, one glyph per patch.

An image is :data:`GRID` x :data:`GRID` cells of :data:`CELL` x :data:`CELL` pixels (4 x 4
cells of 40 px: 160 x 160), filled row by row on white. The reader's vision tower cuts it into
patches of exactly one cell, so each image becomes 16 tokens in reading order. A cell holds one
entry of the reader's glyph set :data:`GLYPHS`:

- a word or number-free symbol (at most :data:`MAX_CHARS` characters), drawn in black in
  Pillow's built-in bitmap font (6 x 11 px per character, no anti-aliasing: the same pixels on
  every platform), centred in the cell;
- a digit or punctuation mark, drawn the same way;
- a coloured mark ``"mark:<colour>"``: a filled square of :data:`MARK` px in a
  :data:`~kvlab.data.synthetic.PALETTE` colour;
- nothing (``""``, a blank cell).

:func:`cell_text` says which text token each cell shows (a word ``w`` is the token of ``" w"``,
as it reads inside a sentence; a digit or a punctuation mark is itself; a blank cell is a space;
a mark is its colour word), which is what the reader model maps the cell's patch to. The
vocabularies the reader's tasks draw from (:mod:`kvlab.data.reader_tasks`) live here too: they
are the reader's alphabet, fixed when the model is built.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from kvlab.data.synthetic import PALETTE

CELL = 40
GRID = 4
IMAGE_SIZE = CELL * GRID
CELLS_PER_IMAGE = GRID * GRID
#: the widest word a cell holds (6 px per character of the bitmap font, 2 px margins)
MAX_CHARS = 6
MARK = 24
MARK_PREFIX = "mark:"
INK = (0, 0, 0)
BACKGROUND = (255, 255, 255)

DIGITS = tuple("0123456789")
PUNCTUATION = (".", ":", ",", "?")
#: the colours of marks: four, so that a linear read-out can tell them apart (a uniform square's
#: features are affine in its RGB, and four affinely independent colours map to any four points)
COLOURS = ("red", "green", "blue", "yellow")
MARKS = tuple(f"{MARK_PREFIX}{c}" for c in COLOURS)

# ---- the tasks' vocabularies (every word one SmolLM2 token with its leading space) ------------
LABEL_WORDS = ("Image", "The", "secret", "code", "is", "marks", "are", "A")
NOUNS = (
    "dog", "cat", "boat", "tree", "lamp", "cake", "house", "road", "bread", "child", "chair", "door",
    "book", "cup", "hat", "ship", "bell", "kite", "shoe", "coat", "horse", "bird", "fish", "clock",
)  # fmt: skip
ADJECTIVES = (
    "small",
    "tall",
    "old",
    "new",
    "big",
    "happy",
    "quiet",
    "long",
    "warm",
    "soft",
    "empty",
    "round",
)
#: the keys of the table task (capitalised, as in a form)
FIELDS = ("Name", "City", "Pet", "Fruit", "Day", "Sport", "Drink", "Colour")
#: filler prose of the document task: subjects, verbs, places (no digits, no field words)
FILLER_SUBJECTS = ("We", "They", "My aunt", "The kids", "A man", "Our dog", "The girl", "Two boys")
FILLER_VERBS = ("walked", "ran", "sat", "played", "slept", "waited", "sang", "read")
FILLER_PLACES = (
    "by the river",
    "in the park",
    "near the house",
    "on the grass",
    "at the shop",
    "under a tree",
)
FILLER_WORDS = (
    "by",
    "the",
    "in",
    "near",
    "on",
    "at",
    "under",
    "a",
    "all",
    "day",
    "for",
    "an",
    "hour",
    "then",
)


def _words(*groups: Sequence[str]) -> list[str]:
    out: list[str] = []
    for group in groups:
        for phrase in group:
            for word in phrase.split():
                if word not in out:
                    out.append(word)
    return out


#: every cell the reader knows, blank first; the model is fitted on exactly these
GLYPHS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            "",
            *DIGITS,
            *PUNCTUATION,
            *MARKS,
            *_words(
                LABEL_WORDS,
                NOUNS,
                ADJECTIVES,
                FIELDS,
                FILLER_SUBJECTS,
                FILLER_VERBS,
                FILLER_PLACES,
                FILLER_WORDS,
            ),
        ]
    )
)


def cell_text(cell: str) -> str:
    """The text whose (single) SmolLM2 token the cell shows: ``" word"``, a digit or mark as
    itself, ``" "`` for a blank cell, ``" red"`` for a red mark."""
    if cell == "":
        return " "
    if cell.startswith(MARK_PREFIX):
        return " " + cell.removeprefix(MARK_PREFIX)
    if cell in DIGITS or cell in PUNCTUATION:
        return cell
    return " " + cell


def check_cells(cells: Sequence[str]) -> None:
    """Raise ``ValueError`` for a cell outside :data:`GLYPHS` or more cells than an image holds."""
    if len(cells) > CELLS_PER_IMAGE:
        raise ValueError(f"an image holds {CELLS_PER_IMAGE} cells, got {len(cells)}: {list(cells)}")
    unknown = [c for c in cells if c not in _GLYPH_SET]
    if unknown:
        raise ValueError(f"cells outside the reader's glyph set: {unknown}")


_GLYPH_SET = frozenset(GLYPHS)


@functools.cache
def font() -> ImageFont.ImageFont:
    """Pillow's built-in bitmap font (``load_default_imagefont``, Pillow >= 10.1; the bitmap
    ``load_default`` before that): fixed pixels, no FreeType rasterisation."""
    loader = getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)
    return loader()


def draw_cell(
    image: Image.Image,
    cell: str,
    row: int,
    col: int,
    ink: tuple[int, int, int] = INK,
    offset: tuple[int, int] = (0, 0),
) -> None:
    """Draw ``cell`` into grid cell ``(row, col)`` of ``image`` (in place), shifted by ``offset``
    (dx, dy) pixels; ``ink`` colours text (marks keep their palette colour)."""
    if cell == "":
        return
    x0, y0 = col * CELL + offset[0], row * CELL + offset[1]
    draw = ImageDraw.Draw(image)
    if cell.startswith(MARK_PREFIX):
        side = (CELL - MARK) // 2
        box = (x0 + side, y0 + side, x0 + side + MARK - 1, y0 + side + MARK - 1)
        draw.rectangle(box, fill=PALETTE[cell.removeprefix(MARK_PREFIX)])
        return
    left, top, right, bottom = font().getbbox(cell)
    x = x0 + (CELL - (right - left)) // 2 - left
    y = y0 + (CELL - (bottom - top)) // 2 - top
    draw.text((x, y), cell, font=font(), fill=ink)


def render(cells: Sequence[str]) -> Image.Image:
    """A :data:`IMAGE_SIZE`-square RGB image of ``cells`` (at most :data:`CELLS_PER_IMAGE`),
    filled row by row from the top left; cells past the end are blank.

    Raises:
        ValueError: a cell outside :data:`GLYPHS`, or too many cells.
    """
    check_cells(cells)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    for i, cell in enumerate(cells):
        draw_cell(image, cell, i // GRID, i % GRID)
    return image


def pad(cells: Sequence[str]) -> list[str]:
    """``cells`` followed by blanks up to :data:`CELLS_PER_IMAGE`."""
    return list(cells) + [""] * (CELLS_PER_IMAGE - len(cells))
