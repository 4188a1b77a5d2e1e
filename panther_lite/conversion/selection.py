"""Which layers convert picks and which it must leave alone: target/exclude/filter matching
(Hugging Face PEFT's semantics), candidates, and the reasons a candidate is skipped."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .adapters import adapter_skip_reason
from .config import ModuleFilter, ModuleSelector
from .kinds import frozen_types, kind_of, registered_kinds, sketched_types
from .kinds.strategy import new_record
from .records import SKIPPED, LayerRecord
from .routing import mark_routing


# Parents whose forward reads these children's ``.weight`` directly instead of calling them:
# nn.MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward, and the
# inference fast path of nn.TransformerEncoderLayer passes linear1/linear2 weights to a fused op.
_DIRECT_WEIGHT_READERS = {
    nn.MultiheadAttention: ("out_proj",),
    nn.TransformerEncoderLayer: ("linear1", "linear2"),
}



def _kind_names() -> str:
    return "/".join(kind.name for kind in registered_kinds())


def _entry_matches(entry: str, fqn: str) -> bool:
    return fqn == entry or fqn.endswith("." + entry)


def matches(spec: Union[str, Sequence[str]], fqn: str) -> bool:
    """PEFT's rule: a string is a regex full-matched against the dotted name; a list entry
    matches a name equal to it or ending in ``"." + entry``."""
    if isinstance(spec, str):
        return re.fullmatch(spec, fqn) is not None
    return any(_entry_matches(entry, fqn) for entry in spec)


def _is_target(record: LayerRecord, target_modules: ModuleSelector) -> bool:
    if target_modules is None:
        return True
    if target_modules == "all-linear":
        return record.kind.linear
    return matches(target_modules, record.name)


def frozen_layers(model: nn.Module) -> List[str]:
    """The dotted names of the frozen pairs in ``model`` (:func:`~panther_lite.freeze`)."""
    return [fqn for fqn, module in model.named_modules() if isinstance(module, frozen_types())]


def candidates(model: nn.Module) -> List[LayerRecord]:
    """Every module of ``model`` convert knows how to replace, in model order; the two layers of
    a frozen pair are none (they stand for one sketched layer, already converted)."""
    frozen = tuple(f"{fqn}." if fqn else "" for fqn in frozen_layers(model))
    found = []
    for fqn, module in model.named_modules():
        kind = kind_of(module)
        if kind is not None and not (frozen and fqn.startswith(frozen)):
            found.append(new_record(kind, fqn, module))
    return found


def _check_every_entry_matches(model: nn.Module, name: str, spec: ModuleSelector, names: List[str]) -> None:
    """ValueError naming the entries of a list selector that match no candidate (a misspelt
    name must not be ignored while its neighbours convert)."""
    if spec is None or isinstance(spec, str):
        return
    unmatched = [entry for entry in spec if not any(_entry_matches(entry, fqn) for fqn in names)]
    if unmatched:
        raise ValueError(
            f"{name} entries {unmatched} matched no {_kind_names()} module "
            f"(a list entry matches a dotted name equal to it or ending in '.' + entry); "
            f"the model's candidates are: {name_preview(names)}{_already_sketched_note(model)}"
        )


def name_preview(names: List[str], limit: int = 10) -> str:
    """``names`` quoted and comma-separated, at most ``limit`` of them (then how many more)."""
    shown = ", ".join(repr(name) for name in names[:limit]) or "none"
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def select_layers(
    model: nn.Module,
    target_modules: ModuleSelector,
    exclude_modules: ModuleSelector,
    filter_fn: Optional[ModuleFilter],
) -> List[LayerRecord]:
    """The candidates picked by target/exclude/filter_fn, in model order; ValueError when a
    list entry or the whole selection matches nothing."""
    found = candidates(model)
    names = [record.name for record in found]
    listed_targets = None if target_modules == "all-linear" else target_modules
    _check_every_entry_matches(model, "target_modules", listed_targets, names)
    _check_every_entry_matches(model, "exclude_modules", exclude_modules, names)
    selected = [
        record
        for record in found
        if _is_target(record, target_modules)
        and not (exclude_modules is not None and matches(exclude_modules, record.name))
        and (filter_fn is None or filter_fn(record.module, record.name))
    ]
    if not selected:
        raise ValueError(
            f"no {_kind_names()} module matched target_modules={target_modules!r}, "
            f"exclude_modules={exclude_modules!r}, filter_fn={getattr(filter_fn, '__name__', filter_fn)!r}; "
            f"the model's candidates are: {name_preview(names)}{_already_sketched_note(model)}"
        )
    return selected


def _already_sketched_note(model: nn.Module) -> str:
    """What to do when the model was converted (and frozen) before: its sketched layers and
    frozen pairs are no candidates."""
    sketched = [fqn for fqn, module in model.named_modules() if isinstance(module, sketched_types())]
    frozen = frozen_layers(model)
    note = ""
    if sketched:
        note += (
            f"; the model already holds {len(sketched)} sketched layers ({name_preview(sketched, limit=3)}), which "
            "convert does not convert again: to convert at other sizes, panther_lite.densify(model) first"
        )
    if frozen:
        note += (
            f"; the model holds {len(frozen)} frozen layers ({name_preview(frozen, limit=3)}), which convert does not "
            "convert again (freeze is one-way: convert the model before freezing it)"
        )
    return note


ParameterOwners = Dict[int, List[Tuple[str, nn.Module]]]


def parameter_owners(model: nn.Module) -> ParameterOwners:
    """``id(parameter) -> [(dotted name, owning module)]`` over every alias in ``model``."""
    owners: ParameterOwners = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((f"{module_name}.{attr}".lstrip("."), module))
    return owners


def _reparametrization(module: nn.Module) -> Optional[str]:
    """What recomputes the module's parameters on every call: ``torch.nn.utils.parametrize``
    parametrizations (``parametrizations.weight_norm``/``spectral_norm``, ...) or the older
    hook-based ``weight_norm``/``spectral_norm``; None when nothing does."""
    if parametrize.is_parametrized(module):
        found = [f"{type(p).__name__} on {name!r}" for name, ps in module.parametrizations.items() for p in ps]
        return "the parametrization " + ", ".join(found)
    hooks = [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, (WeightNorm, SpectralNorm))]
    if hooks:
        return "the hook " + ", ".join(f"{type(hook).__name__} on {hook.name!r}" for hook in hooks)
    return None


def _structural_reason(record: LayerRecord, meta_loaded_later: bool) -> Optional[str]:
    """Why the module itself cannot be replaced (root, lazy, meta, custom forward on the class or
    the instance, groups)."""
    module = record.module
    if record.name == "":
        return "the root module cannot be replaced in place; wrap it in a container (e.g. nn.Sequential)"
    if record.is_lazy:
        return "its parameters are not initialized yet (lazy module); run a forward pass first"
    if record.kind.weight(module).is_meta and not meta_loaded_later:
        return (
            "its weight is on the meta device (no values to fit); load the weights first, or rebuild "
            "a converted layout with apply_conversion_config"
        )
    reparametrized = _reparametrization(module)
    if reparametrized is not None:
        return (
            f"its parameters are recomputed on every call by {reparametrized}, which the sketched layer "
            "would drop; remove it first (torch.nn.utils.parametrize.remove_parametrizations, "
            "remove_weight_norm or remove_spectral_norm) or exclude this layer"
        )
    if "forward" in vars(module):
        return (
            "its forward is replaced on the instance (a monkeypatch, or accelerate's device hooks), custom "
            "behaviour the sketched layer would drop"
        )
    return record.kind.custom_behaviour(module) or record.kind.unsupported(module)


def _context_reason(model: nn.Module, record: LayerRecord, owners: ParameterOwners) -> Optional[str]:
    """Why the layer's surroundings forbid the swap (direct weight reads, shared parameters)."""
    parent_name, _, child = record.name.rpartition(".")
    parent = model.get_submodule(parent_name)
    for reader, children in _DIRECT_WEIGHT_READERS.items():
        if isinstance(parent, reader) and child in children:
            return f"its parent {type(parent).__name__} reads {child}.weight directly instead of calling it"
    for attr, tensor in record.kind.tensors(record.module).items():
        others = [name for name, owner in owners.get(id(tensor), []) if owner is not record.module]
        if others:
            return f"{attr} is tied to {', '.join(others)} (the same Parameter)"
    return None


def mark_unconvertible(model: nn.Module, records: List[LayerRecord], *, meta_loaded_later: bool = False) -> None:
    """Mark ``"skipped"``, with the reason, each selected layer that cannot be swapped
    without changing what the model computes or breaking the code around it, and keep the
    routers of mixtures of experts dense (:func:`~panther_lite.conversion.routing.mark_routing`). A layer whose
    weight is on the meta device has no values to fit, unless ``meta_loaded_later`` (a pipeline
    that loads each block's weights itself before fitting it)."""
    owners = parameter_owners(model)
    for record in records:
        reason = (
            adapter_skip_reason(record.module, record.name)
            or _structural_reason(record, meta_loaded_later)
            or _context_reason(model, record, owners)
        )
        if reason is not None:
            record.skip(SKIPPED, reason)
        elif record.kind.behaviour_note(record.module):
            record.note(record.kind.behaviour_note(record.module))
    mark_routing(model, records)
