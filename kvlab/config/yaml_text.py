"""Reading YAML that a user wrote: one meaning per text, or a one-paragraph :class:`ConfigError`.

Every config file, override value and sweep value kvlab reads goes through :func:`parse_yaml`,
which is ``yaml.safe_load`` (no tags: nothing is constructed but plain values) with four refusals
that ``safe_load`` does not make:

- **duplicate keys**: ``safe_load`` keeps the last of two equal keys in a mapping, so a second
  ``model:`` block would silently replace the first. The error names the key and both lines.
- **alias expansion**: anchors and aliases (``&a`` / ``*a``) are allowed, but the document as
  it would be written out without them (every alias expanded) may hold at most
  :data:`MAX_NODES` values, so a "billion laughs" document is refused at once instead of
  hanging the merge that walks it.
- **depth**: at most :data:`MAX_DEPTH` nested mappings and lists (no config needs more; deeper
  documents would exhaust Python's recursion in the merge and the checks).
- **encoding**: a file must be UTF-8; the error names the byte offset of the first bad byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvlab.config.errors import ConfigError

#: the most values a document may hold once its aliases are expanded
MAX_NODES = 100_000
#: the deepest nesting of mappings and lists a document may have
MAX_DEPTH = 64


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate keys (checked when a mapping is constructed)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if first is not None:
                raise _DuplicateKey(key, first, line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _measure(node: yaml.Node, where: str) -> None:
    """Refuse a composed document deeper than :data:`MAX_DEPTH` or larger than :data:`MAX_NODES`
    once its aliases are expanded (sizes are memoised per node, so this is linear in the text)."""
    sizes: dict[int, int] = {}

    def size(current: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ConfigError(
                f"{where} nests mappings and lists more than {MAX_DEPTH} levels deep. kvlab configs need "
                "a few levels; flatten the document."
            )
        if id(current) in sizes:
            return sizes[id(current)]
        total = 1
        if isinstance(current, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in current.value)
        elif isinstance(current, yaml.SequenceNode):
            total += sum(size(item, depth + 1) for item in current.value)
        sizes[id(current)] = total
        if total > MAX_NODES:
            raise ConfigError(
                f"{where} expands to more than {MAX_NODES} values once its YAML aliases (*name) are "
                "expanded, which no kvlab config needs (a document that multiplies aliases is a known way "
                "to exhaust memory). Write the values out, or use fewer nested aliases."
            )
        return total

    size(node, 0)


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)`` with the refusals of the module docstring; ``where`` names the source
    (a file, or ``--model.compression.budget``) in every error."""
    try:
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _measure(node, where)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _DuplicateKey as dup:
        raise ConfigError(
            f"{where}: the key {dup.key!r} appears twice in one mapping (lines {dup.first} and "
            f"{dup.second}); "
            "YAML would keep only the second, so one of them would be silently ignored. Remove or merge one "
            "of them."
        ) from None
    except yaml.constructor.ConstructorError as exc:
        mark = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        tag = (exc.problem or "").split("tag ")[-1]
        raise ConfigError(
            f"{where}{mark}: the YAML tag {tag} is refused. Configs hold plain values only (mappings, "
            "lists, strings, numbers, booleans); tags such as !!python/object could construct objects "
            "or run code, so kvlab reads YAML with safe_load. Remove the tag and write the value itself."
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{where} is not valid YAML: {' '.join(str(exc).split())}. Fix the syntax at the position shown."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{where} nests mappings and lists too deeply to be read (more than {MAX_DEPTH} levels are "
            "refused). Flatten the document."
        ) from None


def read_text(path: Path, what: str = "config file") -> str:
    """The text of a UTF-8 file; :class:`ConfigError` naming the file and the first bad byte otherwise."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text: byte {exc.start} (0x{data[exc.start]:02x}) cannot be decoded. "
            "Save the file as UTF-8."
        ) from None


def load_yaml_file(path: Path, what: str = "config file") -> Any:
    """:func:`parse_yaml` of a UTF-8 file (see :func:`read_text`)."""
    return parse_yaml(read_text(path, what), str(path))
