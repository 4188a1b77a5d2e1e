"""Mixture-of-experts structure among the selected layers: which layers are *routers* (their
outputs choose the experts; kept dense) and which are *routed experts* (each calibrated on the
tokens the router sends it, fitted to its weights alone when those are fewer than its inputs).

Two layouts are recognised:

- a fused experts module (:class:`~panther_lite.conversion.kinds.experts.ExpertsKind`, ``E``
  experts in 3-D weights), and
- per-expert modules of older code: an ``nn.ModuleList``/``nn.ModuleDict`` whose name contains
  ``"expert"`` holding ``E >= 2`` modules of one class (Mixtral's ``experts`` of ``w1/w2/w3``
  MLPs, Switch Transformers' ``experts``); the layers inside are routed experts.

A router is a selected layer beside such experts (a child of their parent, or a grandchild
outside the experts) with ``E`` outputs: one logit per expert (``gate``, ``router.classifier``).
transformers' own routers (``MixtralTopKRouter``, ...) hold a bare weight, so they are no
candidates and stay dense anyway.
"""
from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from .kinds.experts import ExpertsKind
from .records import KEPT_DENSE, LayerRecord

__all__ = ["mark_routing"]


def _expert_lists(model: nn.Module) -> Dict[str, int]:
    """``{dotted name: E}`` of the per-expert module lists in ``model``."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or "expert" not in name.rpartition(".")[2].lower():
            continue
        children = list(module.children())
        if len(children) >= 2 and len({type(child) for child in children}) == 1:
            found[name] = len(children)
    return found


def _is_router(record: LayerRecord, parent: str, experts: str, count: int) -> bool:
    """Whether ``record`` sits beside the experts at ``experts`` (under ``parent``, at most two
    levels down, not inside them) with one output per expert."""
    prefix = f"{parent}." if parent else ""
    if not record.name.startswith(prefix) or record.name.startswith(f"{experts}.") or record.name == experts:
        return False
    depth = record.name[len(prefix):].count(".")
    return depth <= 1 and not isinstance(record.kind, ExpertsKind) and record.fan_out == count


def mark_routing(model: nn.Module, records: List[LayerRecord]) -> None:
    """Keep the routers among ``records`` dense (with the reason) and flag the layers inside
    per-expert lists as ``routed`` (see the module docstring)."""
    groups = _expert_lists(model)
    groups.update({r.name: r.parts[0].copies for r in records if isinstance(r.kind, ExpertsKind) and not r.is_lazy})
    for experts, count in groups.items():
        parent = experts.rpartition(".")[0]
        for record in records:
            if record.name.startswith(f"{experts}.") and not isinstance(record.kind, ExpertsKind):
                record.routed = True
            elif record.to_convert and not record.is_lazy and _is_router(record, parent, experts, count):
                record.skip(
                    KEPT_DENSE,
                    f"a router: its {count} outputs choose among the experts at {experts!r}, so an error in them "
                    "sends tokens to other experts; kept dense",
                )
