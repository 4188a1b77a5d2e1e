"""Conversion configs: the JSON-serialisable layout of a converted model's sketched (and frozen)
layers, each entry written by its layer kind, and rebuilding that layout in a fresh copy of the
dense model so a converted ``state_dict`` loads into it."""
from __future__ import annotations

import collections
import inspect
import operator
import warnings
from typing import List, Mapping, Tuple

import torch.nn as nn

from ..kinds import LayerKind, converted_kind, default_kind_for, kind_named, registered_kinds
from ..surgery import swap_modules

CONFIG_FORMAT = "panther_lite.conversion"
CONFIG_VERSION = 1

_ENTRY_FIELDS = ("name", "kind", "shape", "num_terms", "low_rank", "bias")


def _entry(fqn: str, module: nn.Module, kind: LayerKind, frozen: bool) -> dict:
    """The config entry of a sketched layer, or of a frozen one (its sketched layer's, with
    ``frozen: true``), written by its kind (:meth:`~panther_lite.conversion.kinds.LayerKind.config_entry`)."""
    entry = dict(name=fqn, **kind.config_entry(module, frozen))
    return dict(entry, frozen=True) if frozen else entry


def conversion_config(model: nn.Module) -> dict:
    """The JSON-serialisable layout of the sketched layers in ``model``.

    ``{"format": "panther_lite.conversion", "version": 1, "layers": [{"name", "kind",
    "dense", "shape", "num_terms", "low_rank", "bias"}, ...]}`` with ``kind`` the sketched
    class (``"SKLinear"``, ``"SKConv1d"``, ``"SKConv2d"``, ``"SKConv3d"``), ``dense`` the
    layer it replaced (``"Linear"``, ``"Conv1D"`` for transformers' GPT-2 layer,
    ``"Conv1d"``, ``"Conv2d"``, ``"Conv3d"``) and ``shape`` that dense
    layer's weight shape. Save it next to the ``state_dict``; :func:`~panther_lite.apply_conversion_config`
    rebuilds the architecture from it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = []
    for fqn, module in model.named_modules():
        found = converted_kind(module)
        if found is not None:
            layers.append(_entry(fqn, module, *found))
    return dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=layers)


def _is_count(value) -> bool:
    """An integer >= 1 (Python or NumPy; not a bool)."""
    try:
        return not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        return False


def _check_entry(index: int, entry) -> LayerKind:
    """The dense kind of one ``layers`` entry; ValueError naming the bad field."""
    where = f"config['layers'][{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(entry).__name__}")
    missing = [field for field in _ENTRY_FIELDS if field not in entry]
    if missing:
        raise ValueError(f"{where} is missing {missing} (expected the fields {list(_ENTRY_FIELDS)})")
    if not isinstance(entry["name"], str):
        raise ValueError(f"{where}['name'] must be a dotted module name (str), got {entry['name']!r}")
    where = f"{where} (layer {entry['name']!r})"
    for field in ("num_terms", "low_rank"):
        if not _is_count(entry[field]):
            raise ValueError(f"{where}: {field!r} must be an integer >= 1, got {entry[field]!r}")
    for field in ("bias", "frozen"):
        if not isinstance(entry.get(field, False), bool):
            raise ValueError(f"{where}: {field!r} must be true or false (a JSON boolean), got {entry[field]!r}")
    shape = entry["shape"]
    if not isinstance(shape, (list, tuple)) or not shape or not all(_is_count(size) for size in shape):
        raise ValueError(f"{where}: 'shape' must be a list of positive integers, got {shape!r}")
    default = default_kind_for(entry["kind"]) if isinstance(entry["kind"], str) else None
    dense = entry.get("dense", None if default is None else default.name)
    kind = kind_named(dense) if isinstance(dense, str) else None
    if kind is None or kind.sketched_type.__name__ != entry["kind"]:
        known = [(k.sketched_type.__name__, k.name) for k in registered_kinds()]
        raise ValueError(
            f"{where}: unknown kind {entry['kind']!r} with dense {dense!r}, expected one of (kind, dense) {known}"
        )
    return kind


def _check_config(config) -> List[Tuple[Mapping, LayerKind]]:
    if not isinstance(config, Mapping) or config.get("format") != CONFIG_FORMAT:
        raise ValueError(f"config must be a dict from conversion_config() with format={CONFIG_FORMAT!r}")
    if config.get("version") != CONFIG_VERSION:
        raise ValueError(f"unsupported conversion config version {config.get('version')!r}, expected {CONFIG_VERSION}")
    if "layers" not in config:
        raise ValueError("config has no 'layers' list (the sketched layers conversion_config() recorded)")
    if not isinstance(config["layers"], (list, tuple)):
        raise ValueError(f"config['layers'] must be a list, got {type(config['layers']).__name__}")
    entries = [(entry, _check_entry(index, entry)) for index, entry in enumerate(config["layers"])]
    counts = collections.Counter(entry["name"] for entry, _ in entries)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"config['layers'] lists {duplicates} more than once")
    return entries


def _target_module(model: nn.Module, entry: Mapping, kind: LayerKind) -> Tuple[nn.Module, dict]:
    """The dense module an entry replaces and the extra options its kind builds it with;
    ValueError when the model does not match."""
    fqn = entry["name"]
    if fqn == "":
        raise ValueError("the root module cannot be replaced in place")
    try:
        module = model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(f"layer {fqn!r} from the config does not exist in the model") from None
    if not kind.matches(module):
        raise ValueError(f"layer {fqn!r} is a {type(module).__name__}, the config expects a {kind.name}")
    shape, bias = list(kind.weight(module).shape), kind.bias(module) is not None
    if shape != list(entry["shape"]) or bias != entry["bias"]:
        raise ValueError(
            f"layer {fqn!r} has weight shape {shape} and bias={bias}, "
            f"the config expects {list(entry['shape'])} and bias={entry['bias']}"
        )
    return module, kind.check_entry(module, entry, fqn)


def swap_in_conversion(model: nn.Module, config: Mapping) -> nn.Module:
    """Swap the layers listed in ``config`` (from :func:`conversion_config`) for sketched
    layers of the recorded sizes, in place, so a converted model's ``state_dict`` loads
    into ``model`` (a fresh instance of the original architecture). No fitting happens:
    the new layers hold placeholder values (a sketch of the fresh weights) until the
    state_dict is loaded; entries with ``"frozen": true`` get the frozen pair of standard
    layers (:func:`~panther_lite.freeze`); a layer on the meta device gets a layer on the
    meta device, to materialise with ``load_state_dict(..., assign=True)``.

    The whole config is validated against the model first (ValueError naming the bad
    entry and field: no ``layers``, a field missing or of the wrong type, an unknown kind,
    a layer the model lacks or whose shape differs, ranks that do not fit the layer's shape —
    see :func:`~panther_lite.nn.validation.check_sketch_rank`) and every layer is built on the
    meta device before any is built for real, so a tampered config fails without allocating;
    on any error the model is unchanged.
    Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    targets = [(entry, kind, *_target_module(model, entry, kind)) for entry, kind in _check_config(config)]
    with warnings.catch_warnings():  # the real build below warns (a sketch larger than dense) once
        warnings.simplefilter("ignore", UserWarning)
        for entry, kind, module, options in targets:  # constructor errors first, without allocating
            kind.build_placeholder(module, entry["num_terms"], entry["low_rank"], device="meta", **options)
    replacements = []
    for entry, kind, module, options in targets:
        if kind.weight(module).is_meta:
            new = kind.build_placeholder(module, entry["num_terms"], entry["low_rank"], **options)
        else:  # a sketch of the fresh weights: valid values even before the state_dict loads
            new = kind.build(module, entry["num_terms"], entry["low_rank"], init="sketch", seed=0, **options)
        kind.match_trainability(new, module)
        if entry.get("frozen", False):
            new = kind.frozen_twin(new)
        replacements.append((entry["name"], new))
    swap_modules(model, replacements)
    return model


def own_names_for_experts(model: nn.Module) -> dict:
    """``save_original_format=False`` for a transformers model holding sketched or frozen experts:
    transformers' save would otherwise split the tensors its fused-experts converters match
    (``experts.gate_up_proj.S1``, ...) as if they were the dense stacks, which fails ("Undefined
    Operation") or stores them under other names. The model's own names load back as they are."""
    from ..kinds.experts import EXPERTS

    experts = (EXPERTS.sketched_type, EXPERTS.frozen_type)
    if not any(isinstance(module, experts) for module in model.modules()):
        return {}
    accepted = "save_original_format" in inspect.signature(type(model).save_pretrained).parameters
    return {"save_original_format": False} if accepted else {}
