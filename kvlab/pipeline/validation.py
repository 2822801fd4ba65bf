"""The YAML checks of ``model.compression``: fields, roles, budget settings, the decode policy.

:meth:`kvlab.pipeline.spec.Pipeline.from_config` builds a method from its node with these; every
refusal is a :class:`~kvlab.config.errors.ConfigError` that names the field and the fix. The
schema is in :mod:`kvlab.pipeline.spec`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from kvlab.compression.budget import Budget
from kvlab.compression.channels import CHANNEL_PRUNERS, ChannelPruner
from kvlab.compression.decode import DECODE_POLICIES, DecodePolicy
from kvlab.compression.quantizers import QUANTIZERS, Quantizer
from kvlab.config.capabilities import parameters
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.registry import Registry, to_plain

WHERE = "model.compression"
FIELDS = (
    "budget", "importance", "diversity", "mixer", "allocate", "select", "decode", "schedule", "route",
    "sliding_layers", "quantize", "prefill", "channels",
)  # fmt: skip
SLIDING_LAYERS = ("window", "compress")
SCHEDULES = ("layerwise", "global")
ROUTE_FIELDS = ("rule", "branches")
ALLOCATE_FIELDS = ("layer", "head", "modality")
#: fields of the parent only (a route's branches may not set them)
PARENT_ONLY = ("decode", "schedule", "sliding_layers", "quantize", "prefill", "channels")
ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_fields(node: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """Refuse a key of ``node`` not in ``allowed``, naming the closest field."""
    for key in node:
        if key not in allowed:
            raise ConfigError(
                f"{where} has no field '{key}'.{did_you_mean(key, allowed)} "
                f"Its fields are: {', '.join(allowed)}."
            )


def keyed_by_role(node: Any, where: str) -> dict[str, dict[str, Any]]:
    """``{role: component node}`` from a scorer section (a mapping keyed by role; ``null`` entries dropped).

    A component node without ``name`` takes its role as the name (``value_norm: {}``). A list
    (the old positional form) or a bare component is refused with the mapping to write instead.
    """
    if node is None:
        return {}
    if isinstance(node, list) or (isinstance(node, dict) and isinstance(node.get("name"), str)):
        items = node if isinstance(node, list) else [node]
        suggestion = ", ".join(
            f"{item['name']}: {_inline({k: v for k, v in item.items() if k != 'name'})}"
            if isinstance(item, dict) and isinstance(item.get("name"), str)
            else f"{item}: {{}}"
            for item in items
        )
        raise ConfigError(
            f"{where} must map each scorer's role to the scorer, so that mixers and allocators name "
            f"the scorer they use instead of relying on list order. Write `{where.rsplit('.', 1)[-1]}: "
            f"{{{suggestion}}}` (a key may be any name, e.g. `attention: {{name: window_attention}}`) "
            "and name the roles where they are used: `mixer: {name: mixkv, extrinsic: <role>, "
            "intrinsic: [<role>], diversity: [<role>]}`, `allocate.head.signal: <role>`."
        )
    if not isinstance(node, dict):
        raise ConfigError(
            f"{where} must be a mapping from role to scorer, e.g. "
            f"`{{attention: {{name: window_attention}}}}`, got {node!r}."
        )
    roles: dict[str, dict[str, Any]] = {}
    for role, component in node.items():
        if component is None:
            continue
        if not isinstance(role, str) or not ROLE.match(role):
            raise ConfigError(
                f"{where}: role {role!r} must be a name (letters, digits, underscores), e.g. attention."
            )
        if isinstance(component, str):
            component = {"name": component}
        if not isinstance(component, dict):
            raise ConfigError(
                f"{where}.{role} must be a scorer mapping such as {{name: window_attention}} (or {{}} to "
                f"use the scorer named '{role}'), got {component!r}."
            )
        roles[role] = component if "name" in component else {"name": role, **component}
    return roles


def _inline(node: dict[str, Any]) -> str:
    """``{a: 1, b: x}``: a flow-style YAML mapping for messages."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in node.items()) + "}"


def _given(cls: type, node: dict[str, Any], param: str) -> Any:
    """The value ``node`` gives ``param`` of ``cls``, or the field's default."""
    if param in node:
        return node[param]
    for f in dataclasses.fields(cls):
        if f.name == param:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None if f.default is dataclasses.MISSING else f.default
    return None


def budget_restatements(cls: type, node: dict[str, Any], where: str, budget: Budget | None) -> dict[str, Any]:
    """The parameters of ``cls`` that ``node`` leaves unset and the budget fills; refuse a value
    that differs from the budget's.

    ``cls.budget_settings`` maps a parameter to a budget field (e.g. ``window``). An unset (None)
    parameter takes the budget's value when it is a token count; a set one must equal it. An unset
    parameter of ``cls.required_budget_settings`` that the budget cannot fill (the budget has no
    token count for it, e.g. a ratio budget's ``tokens``) is refused here, when the pipeline is
    built, not when the component first runs.
    """
    filled: dict[str, Any] = {}
    if budget is None:
        return filled
    for param, setting in cls.budget_settings.items():
        own, value = _given(cls, node, param), getattr(budget, setting)
        is_count = isinstance(value, int) and not isinstance(value, bool)
        if own is None:
            if is_count:
                filled[param] = value
            elif param in cls.required_budget_settings:
                raise ConfigError(
                    f"{where} needs {WHERE}.budget.{setting} as a token count (its `{param}`), but the "
                    f"budget gives {setting} = {value!r}: set {WHERE}.budget.{setting} (e.g. "
                    f"`--{WHERE}.budget.{setting} 512`), or `{param}` on {where}."
                )
        elif not is_count or own != value:
            raise ConfigError(
                f"{where}.{param} = {own} differs from {WHERE}.budget.{setting} = {value}: the "
                f"{setting} is set once, in the budget, and {where.rsplit('.', 1)[-1]} reads it from "
                f"there. Remove `{param}` from {where} (or make it equal), and set "
                f"{WHERE}.budget.{setting} to the {setting} you want."
            )
    return filled


def allocator_restatements(
    cls: type, node: dict[str, Any], where: str, allocator: Any, allocator_where: str
) -> dict[str, Any]:
    """The parameters of ``cls`` that ``node`` leaves unset and the layer allocator fills; refuse a
    value that differs from the allocator's.

    ``cls.layer_allocator_settings`` maps a parameter to a parameter of the layer allocator (one
    source per setting, as :func:`budget_restatements`). An unset (None) parameter takes the
    allocator's value; a set one must equal it. An allocator without that parameter leaves a set
    value alone and refuses an unset one (nothing says what it should be).
    """
    filled: dict[str, Any] = {}
    for param, setting in cls.layer_allocator_settings.items():
        own, name = _given(cls, node, param), allocator.registry_name
        if not hasattr(allocator, setting):
            if own is None:
                raise ConfigError(
                    f"{where}.{param} restates {allocator_where}.{setting}, which the layer allocator "
                    f"'{name}' does not have: use a layer allocator with `{setting}` (e.g. the one of "
                    f"the component's method), or set {where}.{param}."
                )
            continue
        value = getattr(allocator, setting)
        if own is None:
            filled[param] = value
        elif own != value:
            raise ConfigError(
                f"{where}.{param} = {own} differs from {allocator_where}.{setting} = {value}: the "
                f"setting is made once, on the layer allocator ('{name}'), and {where.rsplit('.', 1)[-1]} "
                f"reads it from there. Remove `{param}` from {where} (or make it equal)."
            )
    return filled


def check_shared_budget(branch: dict[str, Any], where: str) -> None:
    """A per-head route's branch may not change the layer budget its heads share."""
    allocate = branch.get("allocate")
    layer = allocate.get("layer") if isinstance(allocate, dict) else None
    for key, value in (("budget", branch.get("budget")), ("allocate.layer", layer)):
        if value is not None:
            raise ConfigError(
                f"{where}.{key}: the rule routes each KV head, and the heads of a layer share one layer "
                f"budget; set {WHERE}.{key} on the parent pipeline instead of inside a branch."
            )


def build_component(
    registry: Registry[Any],
    node: Any,
    where: str,
    budget: Budget | None,
    allocator: tuple[Any, str] | None = None,
) -> Any:
    """Build one component from its node with the parameters it restates filled in first
    (:func:`restated_node`): a built component never changes afterwards."""
    return registry.build(restated_node(registry, node, where, budget, allocator), where)


def restated_node(
    registry: Registry[Any],
    node: Any,
    where: str,
    budget: Budget | None,
    allocator: tuple[Any, str] | None = None,
) -> Any:
    """``node`` with the parameters its component restates filled: from the budget
    (:func:`budget_restatements`), from the layer allocator ``(allocator, its field)`` when given
    (:func:`allocator_restatements`), and likewise inside the nodes of the parts the component
    builds from its own fields (``part_registries``: a route rule's metric). A node the registry
    cannot read is returned as it is, for :meth:`~kvlab.config.registry.Registry.build` to refuse."""
    node = to_plain(node)
    if isinstance(node, str):
        node = {"name": node}
    if not isinstance(node, dict) or not isinstance(node.get("name"), str):
        return node
    cls = registry.get(node["name"], where)
    filled = {**node, **budget_restatements(cls, node, where, budget)}
    if allocator is not None:
        filled.update(allocator_restatements(cls, node, where, *allocator))
    for name, part_registry in cls.part_registries.items():
        filled[name] = restated_node(part_registry, _given(cls, node, name), f"{where}.{name}", budget)
    return filled


def build_quantizer(node: Any) -> Quantizer | None:
    """The quantizer of ``model.compression.quantize`` (None when absent or null)."""
    return QUANTIZERS.build(node, f"{WHERE}.quantize") if node is not None else None


def refuse_parts(
    parts: list[Any], decode_policy: Callable[[str, str], str], outside_store: Callable[[str, str], str]
) -> None:
    """Refuse a decode policy other than ``none`` and a selector keeping K/V in a store outside the
    cache (``offloads``), with the caller's message for each, made from the part's field and the
    component's registry name: what a rewritten stored form of the kept entries cannot serve."""
    for part in parts:
        name = part.component.registry_name
        if part.field.endswith(".decode") and name != "none":
            raise ConfigError(decode_policy(part.field, name))
        if getattr(part.component, "offloads", False):
            raise ConfigError(outside_store(part.field, name))


def check_quantizer(quantizer: Quantizer, parts: list[Any]) -> None:
    """Refuse what a quantized prompt region cannot serve, naming the field: a decode policy that
    rescores or moves entries (codes have no slot layout to write into) and a selector keeping K/V
    outside the cache (the retrieved entries would bypass the quantizer)."""
    name = quantizer.registry_name
    refuse_parts(
        parts,
        lambda field, policy: (
            f"{WHERE}.quantize ({name}) stores the kept prompt entries as packed codes, which have no "
            f"slot layout a decode policy can rescore or move entries in, so {field} = {policy} cannot "
            f"run with it. Use `decode: {{name: none}}` (decoded tokens are appended in full precision) "
            f"or remove {WHERE}.quantize."
        ),
        lambda field, selector: (
            f"{WHERE}.quantize ({name}) quantizes what the cache keeps, but {field} = {selector} keeps "
            "K/V in a store outside the cache (fetched per decode step), which the quantizer does not "
            "reach, so the memory figures would mix coded and full-precision entries. Use an evicting "
            f"or merging selector, or remove {WHERE}.quantize."
        ),
    )


def build_channel_pruner(node: Any, budget: Budget | None) -> ChannelPruner | None:
    """The channel pruner of ``model.compression.channels`` (None when absent or null), with the
    budget settings it restates; without a budget, a pruner restating one must be given it."""
    if node is None:
        return None
    where = f"{WHERE}.channels"
    pruner = build_component(CHANNEL_PRUNERS, node, where, budget)
    for param in pruner.budget_settings:
        if budget is None and getattr(pruner, param) is None:
            raise ConfigError(
                f"{where} ({pruner.registry_name}) observes the prompt's last `{param}` queries and takes "
                f"their count from {WHERE}.budget.{param}, but there is no budget (the full cache). Set "
                f"`{where}.{param}` to a number of queries, e.g. 32."
            )
    return pruner


def check_channel_pruner(pruner: ChannelPruner, parts: list[Any], quantized: bool, progressive: bool) -> None:
    """Refuse what a channel-pruned prompt region cannot serve, naming the field: a quantizer (the
    two would each rewrite the kept keys), a decode policy that rescores or moves entries (decoded
    tokens keep every channel, prompt rows do not: a token cannot move into a prompt slot), a
    selector keeping K/V outside the cache (the fetched keys would bypass the pruner) and a
    progressive prefill (the kept entries are held dense between chunks)."""
    name, where = pruner.registry_name, f"{WHERE}.channels"
    if quantized:
        raise ConfigError(
            f"{where} ({name}) stores the kept prompt keys with fewer channels and {WHERE}.quantize stores "
            "them as packed codes; the two do not compose yet (one stored form of the keys per layer). "
            f"Remove one of {where} and {WHERE}.quantize."
        )
    if progressive:
        raise ConfigError(
            f"{where} ({name}) prunes the key channels of the compressed prompt, but {WHERE}.prefill = "
            "progressive holds the kept entries as dense rows between chunks and compresses every chunk. "
            f"Use `{WHERE}.prefill: {{name: once}}` (the default) or remove {where}."
        )
    refuse_parts(
        parts,
        lambda field, policy: (
            f"{where} ({name}) stores the prompt keys with fewer channels than the decoded tokens', so "
            f"{field} = {policy}, which rescores entries and moves decoded tokens into prompt slots, "
            f"cannot run with it. Use `decode: {{name: none}}` or remove {where}."
        ),
        lambda field, selector: (
            f"{where} ({name}) prunes the keys the cache keeps, but {field} = {selector} keeps K/V in a "
            "store outside the cache (fetched per decode step), which the pruner does not reach. Use an "
            f"evicting or merging selector, or remove {where}."
        ),
    )


def build_decode_policy(node: Any, budget: Budget | None) -> DecodePolicy:
    """The decode policy; a policy with a ``recent`` window takes ``budget.window``.

    An explicit ``recent`` must equal a token-count ``budget.window``; with a ratio window
    (a different count per prompt) or no budget, the policy's ``recent`` must be written.
    """
    where = f"{WHERE}.decode"
    node = to_plain(node)
    node = {"name": node} if isinstance(node, str) else node
    if not isinstance(node, dict) or not isinstance(node.get("name"), str):
        return DECODE_POLICIES.build(node, where)  # refused there, naming the field
    name = node["name"]
    if "recent" not in parameters(DECODE_POLICIES.get(name, where)):
        return DECODE_POLICIES.build(node, where)
    window = budget.window if budget is not None else None
    if isinstance(window, int) and not isinstance(window, bool):
        if "recent" in node and node["recent"] != window:
            raise ConfigError(
                f"{where}.recent = {node['recent']} differs from {WHERE}.budget.window = {window}: the "
                f"recent window is set once, in the budget, and the decode policy keeps it too. Remove "
                f"`recent` from {where} and set {WHERE}.budget.window to the window you want."
            )
        node = {**node, "recent": window}
    elif "recent" not in node:
        raise ConfigError(
            f"{where} '{name}' keeps a recent window of a fixed size, and "
            f"{WHERE}.budget.window is {'a fraction of each prompt' if budget else 'not set'}: write "
            f"the decode window in tokens, e.g. `decode: {{name: {name}, recent: 32}}`."
        )
    return DECODE_POLICIES.build(node, where)


def check_schedule(schedule: Any) -> str:
    """``schedule`` (None: layerwise) if it is one of :data:`SCHEDULES`."""
    schedule = schedule or "layerwise"
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"{WHERE}.schedule must be 'layerwise' (compress each layer right after its prefill "
            "attention) or 'global' (score every layer during the prefill, then allocate over all "
            f"layers and compress them), got {schedule!r}.{did_you_mean(str(schedule), SCHEDULES)}"
        )
    return schedule


def check_sliding_layers(sliding_layers: Any) -> str:
    """``sliding_layers`` (None: window) if it is one of :data:`SLIDING_LAYERS`."""
    sliding_layers = sliding_layers or "window"
    if sliding_layers not in SLIDING_LAYERS:
        raise ConfigError(
            f"{WHERE}.sliding_layers must be 'window' (a sliding-window layer keeps the window the "
            "model attends to) or 'compress' (the method compresses within that window), got "
            f"{sliding_layers!r}."
        )
    return sliding_layers


def check_route_node(route: Any, where: str) -> None:
    """A ``route`` node has a ``rule`` and a mapping of ``branches`` and nothing else."""
    if not isinstance(route, dict) or not isinstance(route.get("branches"), dict) or "rule" not in route:
        raise ConfigError(
            f"{where} must be a mapping with 'rule' (e.g. {{name: latch, metric: {{name: ncar}}}}) and "
            "'branches' (branch name -> fields merged over the parent, e.g. {unified: {}})."
        )
    check_fields(route, ROUTE_FIELDS, where)


def check_branch_node(branch: Any, where: str, per_head: bool) -> dict[str, Any]:
    """A branch node (fields merged over the parent): a mapping without the parent-only fields;
    a per-head route's branch may not change the shared layer budget either."""
    branch = branch or {}
    if not isinstance(branch, dict):
        raise ConfigError(f"{where} must be a mapping of pipeline fields, got {branch!r}.")
    for key in PARENT_ONLY:
        if key in branch:
            raise ConfigError(
                f"{where}.{key}: '{key}' applies to the whole pipeline; set it on {WHERE}.{key} instead of "
                "inside a branch."
            )
    if per_head:
        check_shared_budget(branch, where)
    return branch
