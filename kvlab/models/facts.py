"""Model facts: what a component may read of the model beyond one layer's keys, values and queries.

A component declares the facts it reads (``Capabilities(model_facts=...)``, names in
:data:`~kvlab.config.capabilities.MODEL_FACTS`); the engine builds a :class:`ModelFacts` only when
some component declares one, and gives each layer's context a frozen :class:`LayerFacts` holding
only the declared facts (``LayerContext.facts``). A model that cannot provide a declared fact is
refused before it runs: from its config before it loads (:func:`fact_refusal`, through
``Pipeline.bind_model``) and from its modules before the prefill forward (:meth:`ModelFacts.of`).

The facts, for a layer of ``H`` query heads, ``Hkv`` KV heads, head dim ``D`` and hidden size ``E``:

- ``rotary``: :meth:`LayerFacts.rotary` ``(positions [...]) -> (cos, sin)``, each ``[..., D]``
  fp32, the layer's rotary embedding at any positions, computed as transformers' rotary modules
  do (``cat(p * inv_freq, p * inv_freq)``, cos and sin times the rope type's attention scaling),
  so a query at position ``p`` was rotated as ``q * cos + rotate_half(q) * sin``. Refused for a
  3-D rotary embedding (Qwen2-VL's M-RoPE: a position is a (time, height, width) triple), a rotary
  embedding whose frequencies change with the sequence length (``dynamic``, ``longrope``), a
  partial one (``partial_rotary_factor < 1``) and a model without one.
- ``queries_before_rotation``: :meth:`LayerFacts.queries_before_rotation` turns the layer's
  post-RoPE queries back into the queries before rotation, ``[B, H, q, D]`` fp32 (the rotation
  is inverted exactly: ``(q_rot * cos - rotate_half(q_rot) * sin) / scaling**2``), which equals
  ``q_proj(h)`` (after the layer's query norm, if any) up to rounding; the same refusals as
  ``rotary``. ``LayerContext.queries_before_rotation()`` applies it to the held queries.
- ``keys_before_rotation``: :meth:`LayerFacts.keys_before_rotation`, the same inversion for the
  layer's post-RoPE keys, ``[B, Hkv, T, D]`` fp32, which equals ``k_proj(h)`` (after the layer's
  key norm, if any) up to rounding; the same refusals as ``rotary``.
  ``LayerContext.keys_before_rotation()`` applies it to the prompt's keys.
- ``projections``: :attr:`LayerFacts.projections`, the layer's projection weights as stored in
  transformers' ``nn.Linear`` s: ``q [H*D, E]``, ``k [Hkv*D, E]``, ``v [Hkv*D, E]``, ``o [E, H*D]``
  (and the q/k/v biases when the layer has them). Detached views of the parameters, never
  copies: a component reads them and must not write them. Refused for a layer without separate
  ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` linears (e.g. a fused ``qkv_proj``).
- ``hidden_states``: :attr:`LayerFacts.hidden_states`, the layer's attention input ``[B, T, E]``
  in the model's dtype (the hidden states after the layer's input norm, every prompt position,
  padding included), captured during the prefill forward by a forward pre-hook on each layer's
  attention module that exists only while a prefill whose pipeline declares the fact runs
  (:meth:`ModelFacts.capturing`). Every prompt position: a component reading it declares
  ``chunked_prefill=False``; under ``schedule: global`` each waiting layer holds its own until it
  is compressed (one more ``[B, T, E]`` per layer).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.config.capabilities import MODEL_FACTS
from kvlab.config.errors import ConfigError
from kvlab.models.common import text_config

#: the facts read off the layer's rotary embedding (refused alike)
ROTARY_FACTS = ("rotary", "queries_before_rotation", "keys_before_rotation")

#: rope types whose frequencies depend on the sequence length: no rotary embedding of a position alone
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` of ``x [..., D]`` split in halves (transformers' ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class RotaryTable:
    """A layer's rotary embedding: ``inv_freq [D/2]`` fp32 and the attention ``scaling`` of its rope type."""

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[*positions.shape, D]`` fp32, on ``positions``' device."""
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


@dataclass(frozen=True)
class Projections:
    """A layer's projection weights (detached views, shapes ``[out, in]`` as ``nn.Linear`` stores them).

    Attributes:
        q: ``[H*D, E]``; k, v: ``[Hkv*D, E]``; o: ``[E, H*D]`` (E the hidden size).
        q_bias, k_bias, v_bias: ``[H*D]``, ``[Hkv*D]``, ``[Hkv*D]``, or None (no bias; Qwen2 has them).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerFacts:
    """The model facts one layer's components declared, read-only (``LayerContext.facts``).

    Attributes:
        provided: the facts this view holds (the union of what the pipeline's components declared).
        model: the model's name (for messages).
        rotary_table: the layer's rotary embedding (``rotary``, ``queries_before_rotation``,
            ``keys_before_rotation``), or None.
        weights: the layer's projections (``projections``), or None.
        inputs: the layer's attention input ``[B, T, E]`` of this prefill (``hidden_states``), or None.

    A fact that was not declared raises a :class:`~kvlab.config.errors.ConfigError` naming the
    declaration to add: the engine computes or keeps only what components ask for.
    """

    provided: tuple[str, ...] = ()
    model: str = ""
    rotary_table: RotaryTable | None = None
    weights: Projections | None = None
    inputs: torch.Tensor | None = None

    def _require(self, fact: str) -> None:
        if fact not in self.provided:
            raise ConfigError(
                f"the model fact '{fact}' ({MODEL_FACTS[fact]}) was read but not declared: the engine "
                f"provides only the facts a component declares. Add `capabilities = Capabilities("
                f'model_facts=("{fact}",))` to the component\'s class (kvlab.config.capabilities).'
            )

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's rotary ``(cos, sin)`` at ``positions [...]`` (long), each ``[..., D]`` fp32.

        A query ``q`` at position ``p`` is rotated as ``q * cos[p] + rotate_half(q) * sin[p]``;
        the same holds for keys.
        """
        self._require("rotary")
        assert self.rotary_table is not None
        return self.rotary_table(positions)

    def queries_before_rotation(self, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``queries [B, H, q, D]`` at ``positions [B, q]`` rotated back, ``[B, H, q, D]`` fp32."""
        self._require("queries_before_rotation")
        return self._rotated_back(queries, positions)

    def keys_before_rotation(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``keys [B, Hkv, T, D]`` at ``positions [B, T]`` rotated back, ``[B, Hkv, T, D]`` fp32."""
        self._require("keys_before_rotation")
        return self._rotated_back(keys, positions)

    def _rotated_back(self, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotary embedding inverted: ``states [B, heads, n, D]`` at ``positions [B, n]``, fp32."""
        assert self.rotary_table is not None
        cos, sin = self.rotary_table(positions)  # [B, n, D]
        cos, sin = cos[:, None], sin[:, None]
        x = states.float()
        unrotated = x * cos - rotate_half(x) * sin  # = scaling**2 * R(p)^T R(p) x / scaling
        scale = self.rotary_table.scaling
        return unrotated if scale == 1.0 else unrotated / (scale * scale)

    @property
    def projections(self) -> Projections:
        """The layer's q/k/v/o projection weights (:class:`Projections`)."""
        self._require("projections")
        assert self.weights is not None
        return self.weights

    @property
    def hidden_states(self) -> torch.Tensor:
        """The layer's attention input of this prefill, ``[B, T, E]`` in the model's dtype (read-only)."""
        self._require("hidden_states")
        if self.inputs is None:
            raise RuntimeError(
                "the model fact hidden_states was declared but no prefill forward captured it for this layer "
                "(its attention module was not called with hidden_states)"
            )
        return self.inputs


def _rope_parameters(text: Any) -> list[Mapping[str, Any] | None]:
    """The rope parameters of a text config, one mapping per layer type (Gemma 3 has two)."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping | None) for v in params.values()):
        return list(params.values())  # {layer_type: {...}}
    return [params]


def fact_refusal(config: Any, fact: str) -> str | None:
    """Why a model with HF ``config`` cannot provide ``fact`` (a clause), None when it can; the
    config alone is read (the modules are checked by :meth:`ModelFacts.of`)."""
    if fact not in ROTARY_FACTS:
        return None
    text = text_config(config)
    for params in _rope_parameters(text):
        if not isinstance(params, Mapping) or "rope_theta" not in params:
            return "it has no rotary embedding (no rope_parameters with a rope_theta in its config)"
        if params.get("mrope_section") is not None:
            return (
                f"its rotary embedding is 3-D (M-RoPE, mrope_section {list(params['mrope_section'])}): a "
                "position is a (time, height, width) triple, so there is no rotary embedding of one position"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in LENGTH_DEPENDENT_ROPE:
            return (
                f"its rotary embedding (rope_type {rope_type}) changes its frequencies with the prompt length"
            )
        factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
        if factor is not None and float(factor) < 1.0:
            return f"it rotates only part of each head (partial_rotary_factor {factor})"
    return None


def refusal_message(readers: Mapping[str, str], model: str, fact: str, why: str) -> str:
    """The one-paragraph refusal of ``model`` for ``fact``, naming the component that reads it."""
    return (
        f"{readers[fact]} reads the model fact '{fact}' ({MODEL_FACTS[fact]}), which {model} cannot "
        f"provide: {why}. Run this method on a model that has it (a 1-D rotary embedding with separate "
        "q/k/v/o projections: Llama, Qwen2, Mistral, Gemma 3's text model; `kvlab list` shows each "
        "component's model_facts), or use a component that reads no model facts (e.g. `--config snapkv`)."
    )


def check_config_facts(config: Any, model: str, readers: Mapping[str, str]) -> None:
    """Refuse ``model`` (HF ``config``) when it cannot provide a fact of ``readers`` (fact -> the
    YAML field and name of a component reading it).

    Raises:
        ConfigError: naming the component, the fact, why the model lacks it, and the fix.
    """
    for fact in readers:
        why = fact_refusal(config, fact)
        if why is not None:
            raise ConfigError(refusal_message(readers, model, fact, why))


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a transformers causal LM or VLM (``model.model`` or its ``language_model``)."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def _rotary_table(rotary: torch.nn.Module | None, layer_type: str | None) -> RotaryTable | None:
    """The rotary table of a layer of ``layer_type`` from the model's rotary module (one ``inv_freq``,
    or Gemma 3's ``<layer_type>_inv_freq`` per layer type); None when there is none."""
    if rotary is None:
        return None
    prefix = f"{layer_type}_" if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq") else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
    if not torch.is_tensor(inv_freq):
        return None
    return RotaryTable(inv_freq.detach(), float(getattr(rotary, f"{prefix}attention_scaling", 1.0)))


def _projections(attention: torch.nn.Module) -> Projections | None:
    """The layer's projections, None without separate q/k/v/o linears."""
    linears = [getattr(attention, f"{x}_proj", None) for x in "qkvo"]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        return None
    q, k, v, o = linears

    def bias(m: torch.nn.Linear) -> torch.Tensor | None:
        return None if m.bias is None else m.bias.detach()

    return Projections(
        q.weight.detach(), k.weight.detach(), v.weight.detach(), o.weight.detach(), bias(q), bias(k), bias(v)
    )


@dataclass(frozen=True)
class ModelFacts:
    """The declared facts of every layer of a loaded model (built once per prefill, by the engine).

    Attributes:
        layers: one :class:`LayerFacts` per decoder layer, in layer order.
        attention: each decoder layer's attention module, when ``hidden_states`` is declared (its
            forward pre-hook captures them, :meth:`capturing`); empty otherwise.
    """

    layers: tuple[LayerFacts, ...]
    attention: tuple[torch.nn.Module, ...] = ()
    _captured: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: torch.nn.Module, name: str, readers: Mapping[str, str], head_dim: int) -> ModelFacts:
        """Collect the facts of ``readers`` (fact -> the component reading it) from ``model``.

        Raises:
            ConfigError: the model cannot provide one of them (its config, as
                :func:`check_config_facts`, or its modules: no rotary module with ``inv_freq``, a
                rotary table not covering ``head_dim``, no separate q/k/v/o projections).
        """
        check_config_facts(model.config, name, readers)
        lm = language_model(model)
        layers = getattr(lm, "layers", None)
        if layers is None:
            raise ConfigError(
                refusal_message(readers, name, next(iter(readers)), "kvlab finds no decoder layers in it")
            )
        provided = tuple(sorted(readers))
        layer_types = getattr(text_config(model.config), "layer_types", None)
        rotary = getattr(lm, "rotary_emb", None)
        out = []
        for idx, layer in enumerate(layers):
            table = weights = None
            rotary_facts = [fact for fact in ROTARY_FACTS if fact in readers]
            if rotary_facts:
                fact = rotary_facts[0]
                table = _rotary_table(rotary, layer_types[idx] if layer_types else None)
                if table is None:
                    why = "kvlab finds no rotary module with inv_freq on its language model (rotary_emb)"
                    raise ConfigError(refusal_message(readers, name, fact, why))
                if table.head_dim != head_dim:
                    why = f"its rotary embedding covers {table.head_dim} of the {head_dim} dims of a head"
                    raise ConfigError(refusal_message(readers, name, fact, why))
            if "projections" in readers:
                weights = _projections(getattr(layer, "self_attn", layer))
                if weights is None:
                    why = f"layer {idx}'s attention has no separate q_proj/k_proj/v_proj/o_proj linears"
                    raise ConfigError(refusal_message(readers, name, "projections", why))
            out.append(LayerFacts(provided=provided, model=name, rotary_table=table, weights=weights))
        attention = ()
        if "hidden_states" in readers:
            attention = tuple(getattr(layer, "self_attn", layer) for layer in layers)
        return cls(tuple(out), attention)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Within the block (the prefill forward, every layer compressed inside it), each layer's
        attention input is captured when ``hidden_states`` is declared (a forward pre-hook per
        attention module, removed on exit with what it captured); nothing is hooked otherwise."""
        self._captured.clear()

        def capture(idx: int):
            def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                if torch.is_tensor(hidden):
                    self._captured[idx] = hidden.detach()

            return hook

        handles = [
            module.register_forward_pre_hook(capture(idx), with_kwargs=True)
            for idx, module in enumerate(self.attention)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._captured.clear()  # the layers' contexts hold what they need; decoding holds nothing

    def layer(self, layer_idx: int) -> LayerFacts:
        """The facts of decoder layer ``layer_idx`` (with its captured attention input, if declared)."""
        facts = self.layers[layer_idx]
        if not self.attention:
            return facts
        return dataclasses.replace(facts, inputs=self._captured.get(layer_idx))
