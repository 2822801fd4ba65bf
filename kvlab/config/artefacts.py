"""Calibration artefacts: versioned safetensors files of per-model statistics that components load by path.

An artefact is one ``.safetensors`` file: named tensors (e.g. ``scores [L, H]``) plus a JSON
header in the safetensors metadata under the key ``kvlab``::

    {"format": "kvlab-calibration", "version": 1, "kind": "visual_heads",
     "model": "tiny-qwen2-vl", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
     "settings": {...the calibration config...}, "samples": 16, "created": "2026-11-23T..."}

``kvlab calibrate --config FILE`` (:mod:`kvlab.calibration`) writes one; a component takes
``artefact: PATH`` (or ``auto``: ``$KVLAB_CACHE/calibration/<model>/<kind>.safetensors``, then the
artefacts shipped in ``kvlab/calibration/artefacts/``) through the :class:`UsesArtefact` mixin.
Loading an artefact of another kind or made for another model (name or layer/head counts) is a
:class:`~kvlab.config.errors.ConfigError` naming both. The file format is ground: components
read artefacts without importing the calibration run that writes them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvlab.config.capabilities import Component
from kvlab.config.errors import ConfigError

FORMAT = "kvlab-calibration"
VERSION = 1
#: the artefacts shipped with kvlab (data files beside the calibration run)
PACKAGED = Path(__file__).resolve().parent.parent / "calibration" / "artefacts"


@dataclass
class Artefact:
    """Calibration statistics of one model.

    Attributes:
        kind: what was measured (``visual_heads``, ``redundancy``, ...).
        model: the model name the statistics belong to.
        num_layers / num_heads / num_kv_heads: the language model's shape.
        tensors: the statistics (shapes documented by each calibration kind).
        settings: the calibration settings used (config, dataset, sample count).
    """

    kind: str
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tensors: dict[str, torch.Tensor]
    settings: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION
    source: str = ""

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "kind": self.kind,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "settings": self.settings,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically (temporary file, then rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(tmp), metadata={"kvlab": json.dumps(self.header())})
        tmp.chmod(0o644)  # safetensors creates the file private; artefacts are meant to be shared
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path, where: str = "artefact") -> Artefact:
        """Read an artefact; :class:`ConfigError` if it is missing or not a kvlab artefact."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"{where}: calibration artefact '{path}' does not exist. Create it with `kvlab calibrate "
                "--config <calibration config>` (see docs/calibration.md) or fix the path."
            )
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
            header = json.loads(meta["kvlab"])
        except Exception as exc:  # corrupt file, not safetensors, no kvlab header
            raise ConfigError(
                f"{where}: '{path}' is not a kvlab calibration artefact ({type(exc).__name__}: {exc}). "
                "Regenerate it with `kvlab calibrate`."
            ) from exc
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ConfigError(
                f"{where}: '{path}' has format {header.get('format')!r} version {header.get('version')!r}; "
                f"this kvlab reads {FORMAT!r} version {VERSION}. Regenerate it with `kvlab calibrate`."
            )
        return cls(
            kind=header["kind"],
            model=header["model"],
            num_layers=int(header["num_layers"]),
            num_heads=int(header["num_heads"]),
            num_kv_heads=int(header["num_kv_heads"]),
            tensors=tensors,
            settings=header.get("settings", {}),
            source=str(path),
        )

    def check(
        self,
        kind: str,
        where: str,
        model: str | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
    ) -> Artefact:
        """Raise :class:`ConfigError` unless this artefact is of ``kind`` and fits the given model."""
        if self.kind != kind:
            raise ConfigError(
                f"{where}: '{self.source}' holds '{self.kind}' statistics, but this component needs "
                f"'{kind}'. "
                f"Point it at a '{kind}' artefact (kvlab calibrate with calibration.name: {kind})."
            )
        if model is not None and self.model != model:
            raise ConfigError(
                f"{where}: '{self.source}' was calibrated on model '{self.model}', but this run uses "
                f"'{model}'. "
                f"Calibrate this model (`kvlab calibrate --config ... --model {model}`) or use its artefact."
            )
        shape = {"num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads}
        for name, expected in shape.items():
            got = getattr(self, name)
            if expected is not None and got != expected:
                raise ConfigError(
                    f"{where}: '{self.source}' was made for a model with {name} = {got}, but the running "
                    f"model has {expected} (artefact model '{self.model}'). Recalibrate for this model."
                )
        return self


def cache_root() -> Path:
    """``$KVLAB_CACHE`` or ``~/.cache/kvlab`` (where kvlab keeps converted models and artefacts)."""
    return Path(os.environ.get("KVLAB_CACHE") or "~/.cache/kvlab").expanduser()


def cache_path(model: str, kind: str) -> Path:
    """Default artefact location: ``$KVLAB_CACHE/calibration/<model>/<kind>.safetensors``."""
    return cache_root() / "calibration" / model.replace("/", "__") / f"{kind}.safetensors"


def resolve_path(spec: str, model: str | None, kind: str, where: str) -> Path:
    """The file an ``artefact:`` parameter names. ``auto`` looks in the cache, then the shipped artefacts."""
    if spec != "auto":
        return Path(spec).expanduser()
    if model is None:
        raise ConfigError(f"{where} = auto needs the model name; give an explicit artefact path instead.")
    candidates = [cache_path(model, kind), PACKAGED / f"{model.replace('/', '__')}.{kind}.safetensors"]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"{where} = auto: no '{kind}' artefact for model '{model}' (looked in {candidates[0]} and the "
        f"shipped artefacts). Create one with `kvlab calibrate --config {kind} --model {model}`, or give "
        "a path."
    )


class UsesArtefact(Component):
    """Mixin for components with an ``artefact`` parameter (a path, or ``auto``).

    The pipeline calls :meth:`bind_model` with the model name before the model loads (so a
    wrong artefact fails early); :meth:`artefact_for` loads lazily and checks the layer and
    head counts against the running layer.
    """

    artefact_kind: str = ""
    artefact: str = "auto"
    #: the artefact :meth:`bind_model` (or the first :meth:`artefact_for`) loaded; None until then
    loaded_artefact: Artefact | None = None

    def _where(self) -> str:
        return f"model.compression ({getattr(self, 'registry_name', type(self).__name__)}).artefact"

    def bind_model(self, model: str, shape: Mapping[str, int] | None = None) -> None:
        """Resolve and load the artefact for ``model`` and check it was made for that model: its
        name and, given ``shape`` (``num_layers`` / ``num_heads`` / ``num_kv_heads``, read from the
        model's config without weights when it can be), its layer and head counts."""
        path = resolve_path(self.artefact, model, self.artefact_kind, self._where())
        counts = {k: v for k, v in (shape or {}).items() if k in ("num_layers", "num_heads", "num_kv_heads")}
        loaded = Artefact.load(path, self._where()).check(
            self.artefact_kind, self._where(), model=model, **counts
        )
        self.loaded_artefact = loaded

    def artefact_for(self, ctx: Any) -> Artefact:
        """The loaded artefact, checked against ``ctx``'s layer count and head counts."""
        loaded = self.loaded_artefact
        if loaded is None:
            if self.artefact == "auto":
                raise ConfigError(
                    f"{self._where()} = auto, but no model was bound (kvlab binds it when a run starts); "
                    "give an explicit path."
                )
            loaded = Artefact.load(self.artefact, self._where()).check(self.artefact_kind, self._where())
            self.loaded_artefact = loaded
        return loaded.check(
            self.artefact_kind,
            self._where(),
            num_layers=ctx.num_layers,
            num_heads=ctx.num_heads,
            num_kv_heads=ctx.num_kv_heads,
        )
