"""What the benchmark datasets share: parameter checks, reading a suite's rows, filling templates.

A downloaded suite is read from ``path``, one of:

- a local directory holding one JSON-lines file per task (``<task>.jsonl``, the layout of the
  suites' own downloads: LongBench's ``data.zip``, InfiniteBench's ``download_dataset.sh``,
  LooGLE's ``LooGLE-testdata/``);
- a directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` keyed by task or
  split);
- a Hugging Face Hub id (``THUDM/LongBench``), read with ``datasets.load_dataset`` as the ``hf``
  dataset reads it; offline runs need a cached copy (``HF_HUB_OFFLINE=1``).

Rows are plain dicts in the suite's own schema; each suite module checks the fields it uses.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.data.jsonl import read_json_lines
from kvlab.data.synthetic import filler_sentence

__all__ = [
    "HaystackWords",
    "check_count",
    "check_tasks",
    "fill",
    "read_haystack",
    "read_task_rows",
    "split_at_context",
    "split_sentences",
]


def check_tasks(
    tasks: Any, known: Iterable[str], suite: str, refused: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """``data.dataset.tasks`` as a tuple: a non-empty list of distinct known task names.

    Args:
        tasks: the configured value.
        known: the suite's task names.
        suite: the dataset's name (for the message).
        refused: tasks kvlab knows but cannot run, with the reason.
    """
    known = list(known)
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list | tuple) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ConfigError(
            f"data.dataset.tasks must be a non-empty list of {suite} task names, got {tasks!r}. "
            f"Tasks: {', '.join(known)}."
        )
    for task in tasks:
        if refused and task in refused:
            raise ConfigError(f"data.dataset.tasks: {suite} task '{task}' is not supported: {refused[task]}")
        if task not in known:
            raise ConfigError(
                f"data.dataset.tasks: unknown {suite} task '{task}'.{did_you_mean(task, known)} "
                f"Tasks: {', '.join(known)}."
            )
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"data.dataset.tasks lists a task twice ({list(tasks)}); list each task once.")
    return tuple(tasks)


def check_count(value: Any, field: str, least: int = 1, allow_none: bool = False) -> None:
    """Refuse a non-integer ``data.dataset.<field>`` or one below ``least``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        also = " or null" if allow_none else ""
        raise ConfigError(
            f"data.dataset.{field} must be an integer >= {least}{also}, got {value!r}. Fix the value."
        )


def split_at_context(template: str) -> tuple[str, str]:
    """A prompt template cut at its ``{context}`` field: ``(before, after)``."""
    before, sep, after = template.partition("{context}")
    if not sep or "{context}" in after:
        raise ValueError(f"template must hold exactly one {{context}} field: {template!r}")
    return before, after


def fill(template: str, **fields: Any) -> str:
    """``template.format(**fields)``; a field the template does not name is ignored."""
    names = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    return template.format(**{k: v for k, v in fields.items() if k in names})


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    fix = "The file must hold one JSON object per line, as the benchmark ships it; re-extract the download."
    return [row for _, row in read_json_lines(file, fix)]


def _load_hf(path: str, subset: str | None, split: str, features: Any = None) -> Any:
    try:
        import datasets  # datasets: 1.7 s to import, only when a Hub dataset is read (kvlab list)
    except ImportError:
        raise ConfigError("data.dataset.path: reading a Hub dataset needs `pip install datasets`.") from None
    try:
        loaded = datasets.load_dataset(path, subset, features=features)
    except Exception as exc:  # datasets raises many types (not found, offline, bad config)
        raise ConfigError(
            f"data.dataset.path: cannot load '{path}' (subset {subset!r}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. Check the Hub id (offline "
            "runs need a cached copy), or download the suite and point `path` at its directory of "
            "<task>.jsonl files."
        ) from None
    if split not in loaded:
        raise ConfigError(
            f"data.dataset.path: '{path}' (subset {subset!r}) has no split '{split}' (splits: "
            f"{', '.join(loaded)})."
        )
    return loaded[split]


def read_task_rows(
    path: str,
    task: str,
    files: Iterable[str],
    hub_subset: str | None,
    hub_split: str,
    features: Any = None,
) -> list[dict[str, Any]]:
    """The rows of one task of a downloaded suite (see the module docstring for ``path``).

    Args:
        path: ``data.dataset.path``.
        task: the task (the key of a ``save_to_disk`` ``DatasetDict``).
        files: file names that hold the task in a local directory, first found wins.
        hub_subset / hub_split: where the task is on the Hub (subset = config name).
        features: ``datasets.Features`` to cast the Hub files to (InfiniteBench's mixed types).
    """
    local = Path(path).expanduser()
    files = list(files)
    if local.is_dir():
        for name in files:
            if (local / name).is_file():
                return _read_jsonl(local / name)
        if any((local / f).is_file() for f in ("state.json", "dataset_dict.json")):
            import datasets  # datasets: 1.7 s to import, only when a saved dataset is read

            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                key = task if task in loaded else hub_split
                if key not in loaded:
                    raise ConfigError(
                        f"data.dataset.path: the saved dataset {local} has no '{task}' or '{hub_split}' "
                        f"split (splits: {', '.join(loaded)})."
                    )
                loaded = loaded[key]
            return [dict(row) for row in loaded]
        present = sorted(p.name for p in local.glob("*.jsonl"))[:12]
        raise ConfigError(
            f"data.dataset.path: {local} has no file for task '{task}' (looked for {', '.join(files)}; "
            f"JSON-lines files there: {', '.join(present) or 'none'}). Point `path` at the directory "
            "of the extracted download, or use the Hub id."
        )
    if path.startswith(("/", ".", "~")) or local.exists() or "/" not in path:
        raise ConfigError(
            f"data.dataset.path: {local.resolve()} is not a directory (and '{path}' is not a Hub id "
            "org/name). Point `path` at the directory holding the suite's <task>.jsonl files."
        )
    return [dict(row) for row in _load_hf(path, hub_subset, hub_split, features)]


# --- haystacks ---------------------------------------------------------------------------------
def read_haystack(path: str, field: str = "data.dataset.haystack_path") -> str:
    """The text of a haystack file: a ``.txt`` file, a directory of ``.txt`` files (joined in
    name order, as the needle test reads its essays) or a JSON file with a ``text`` field
    (RULER's ``PaulGrahamEssays.json``)."""
    source = Path(path).expanduser()
    if source.is_dir():
        files = sorted(source.glob("*.txt"))
        if not files:
            raise ConfigError(f"{field}: the directory {source} holds no .txt files. Point it at the essays.")
        return "".join(f.read_text(encoding="utf-8") for f in files)
    if not source.is_file():
        raise ConfigError(
            f"{field}: {source} does not exist. Give a .txt file, a directory of .txt files or a JSON "
            "file with a `text` field (RULER's PaulGrahamEssays.json), or remove the field to use "
            "kvlab's generated filler."
        )
    if source.suffix.lower() == ".json":
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{field}: {source} is not valid JSON ({exc.msg}).") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise ConfigError(f"{field}: {source} must be a JSON object with a string `text` field.")
        return data["text"]
    return source.read_text(encoding="utf-8")


class HaystackWords:
    """The words of a haystack: a file's (:func:`read_haystack`), or kvlab's filler prose
    (:func:`kvlab.data.synthetic.filler_sentence` from ``random.Random(f"{seed}:haystack")``,
    generated on demand; every prefix is the same whatever the length asked).

    :meth:`take` repeats the text cyclically past its end, as RULER does with its essays.
    """

    def __init__(self, path: str | None, seed: int):
        self.generated = path is None
        self._rng = random.Random(f"{seed}:haystack")
        self._words: list[str] = (
            [] if path is None else re.sub(r"\s+", " ", read_haystack(path)).strip().split(" ")
        )
        if not self.generated and not self._words:
            raise ConfigError(f"data.dataset.haystack_path: {path} holds no text.")

    def take(self, n: int) -> list[str]:
        """The first ``n`` words (cycling through a file's text when it is shorter)."""
        if self.generated:
            while len(self._words) < n:
                self._words.extend(filler_sentence(self._rng).split())
            return self._words[:n]
        if n <= len(self._words):
            return self._words[:n]
        repeats = -(-n // len(self._words))
        return (self._words * repeats)[:n]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` split after ``.``, ``!`` or ``?`` followed by whitespace (RULER uses
    NLTK's ``sent_tokenize``, which kvlab does not ship; on prose the two agree but for
    abbreviations)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]
