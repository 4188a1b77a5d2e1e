"""PEFT awareness for conversion: which modules belong to an adapter and must stay as they are.

A PEFT model (LoRA, DoRA, IA3, LoKr, ...) wraps each targeted layer in a *tuner layer* that
holds the frozen original as ``base_layer`` and the adapter's own small modules under names
such as ``lora_A`` / ``lora_B``. None of these may be sketched:

- adapter modules are already tiny trainable factors; PEFT reads their ``weight`` directly
  (``lora_B.weight @ lora_A.weight`` when merging), so a sketched adapter breaks forward,
  ``merge_and_unload()`` and saving of the adapter;
- a base layer is what ``merge_and_unload()`` writes the adapter's update into
  (``base_layer.weight.data += delta``); a sketched base layer has no dense weight to write
  to, so the merge would fail or silently drop the update.

``modules_to_save`` copies (``ModulesToSaveWrapper``) are PEFT-managed trainable copies and are
skipped for the same reason. The recommended orders are: compress first and fine-tune the S
factors (they are already parameter-efficient), or ``merge_and_unload()`` first and compress
the merged model.

peft is an optional dependency and is never imported here: a module can only be part of a
PEFT model if peft has already been imported by whoever built that model, so looking peft up
in ``sys.modules`` is exact, and costs nothing for users without peft.
"""
from __future__ import annotations

import sys
from typing import FrozenSet, Iterator, Optional

import torch.nn as nn

__all__ = ["adapter_skip_reason"]

# PEFT's attribute names for a tuner layer's frozen original and for the copies kept by
# ``ModulesToSaveWrapper`` (peft.utils.other).
_BASE_LAYER = "base_layer"
_SAVED_COPIES = ("modules_to_save", "original_module")


def _tuner_layer_class() -> Optional[type]:
    """``peft.tuners.tuners_utils.BaseTunerLayer`` if peft is loaded, else None."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(tuners_utils, "BaseTunerLayer", None)


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _adapter_layer_names(tuner_layer: type) -> FrozenSet[str]:
    """Names of adapter modules over every loaded PEFT tuner (``lora_A``, ``ia3_l``, ...).

    Each tuner class declares its own in ``adapter_layer_names``; a tuner's class is loaded
    before any of its layers can exist, so walking the loaded subclasses sees them all.
    """
    names = set(tuner_layer.adapter_layer_names)
    for sub in _subclasses(tuner_layer):
        names.update(getattr(sub, "adapter_layer_names", ()))
    return frozenset(names)


def adapter_skip_reason(module: nn.Module, fqn: str) -> Optional[str]:
    """Why ``module`` (at dotted name ``fqn``) belongs to a PEFT adapter and must not be converted.

    Args:
        module: a candidate module of the model being converted.
        fqn: its fully qualified name in that model (as ``named_modules`` gives it).

    Returns:
        a reason for the conversion report, or None when the module is not part of a PEFT
        adapter (always None when peft has not been imported).
    """
    tuner_layer = _tuner_layer_class()
    if tuner_layer is None:
        return None
    if isinstance(module, tuner_layer):
        return (
            f"PEFT tuner layer ({type(module).__name__}): merge_and_unload() the adapters "
            "before converting"
        )
    parts = fqn.split(".")
    adapter_names = _adapter_layer_names(tuner_layer)
    for part in parts:
        if part in adapter_names:
            return f"PEFT adapter module ({part}): adapters are already small trainable factors"
    if _BASE_LAYER in parts:
        return (
            "base layer of a PEFT tuner layer: merge_and_unload() writes the adapter update "
            "into its dense weight; merge_and_unload() first, then convert"
        )
    for part in _SAVED_COPIES:
        if part in parts:
            return f"PEFT modules_to_save copy ({part}): managed and saved by PEFT"
    return None
