"""The layout of a directory :func:`~panther_lite.save_pretrained` writes: the record's file name,
format and version, the key under which each Hugging Face ``config.json`` records its conversion,
the libraries a model can be saved with, and the transformers models inside a model (whose
configs record their part of the conversion)."""
from __future__ import annotations

import os
import sys
from typing import List, Mapping, Tuple, Union

import torch.nn as nn

__all__ = [
    "PRETRAINED_CONFIG_NAME", "FORMAT", "VERSION", "HF_CONFIG_KEY", "QUANTIZATION_KEY", "QUANT_METHOD", "TRANSFORMERS", "SENTENCE_TRANSFORMERS", "STATE_DICT",
    "PathLike", "pretrained_model_class", "sentence_transformer_classes", "hf_submodels", "relative_config",
]

PRETRAINED_CONFIG_NAME = "panther_lite_config.json"
FORMAT, VERSION = "panther_lite.pretrained", 1
# where config.json recorded its conversion before the quantizer plugin (read, never written)
HF_CONFIG_KEY = "panther_lite"
# where config.json records it now: transformers' quantizer extension point (:mod:`.hf_quantizer`)
QUANTIZATION_KEY = "quantization_config"
# its "quant_method": the name the plugin registers under
QUANT_METHOD = "panther_lite"

TRANSFORMERS, SENTENCE_TRANSFORMERS, STATE_DICT = "transformers", "sentence-transformers", "state_dict"
PathLike = Union[str, "os.PathLike[str]"]


def loaded_class(module: str, name: str):
    """A class of an optional dependency if it has been imported, else None (never imports)."""
    return getattr(sys.modules.get(module), name, None)


def pretrained_model_class():
    """transformers' ``PreTrainedModel`` if transformers has been imported, else None."""
    return loaded_class("transformers.modeling_utils", "PreTrainedModel")


def sentence_transformer_classes() -> tuple:
    """sentence-transformers' model classes if it has been imported, else ``()``."""
    base = loaded_class("sentence_transformers.base.model", "BaseModel")
    if base is not None:
        return (base,)
    legacy = loaded_class("sentence_transformers", "SentenceTransformer")
    return () if legacy is None else (legacy,)


def hf_submodels(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The outermost transformers models inside ``model`` (itself included), with their names."""
    pretrained = pretrained_model_class()
    if pretrained is None:
        return []
    found: List[Tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        inside_found = any(outer == "" or fqn.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(module, pretrained) and not inside_found:
            found.append((fqn, module))
    return found


def relative_config(conversion: Mapping, prefix: str) -> dict:
    """The part of a conversion config under submodule ``prefix``, with names relative to it."""
    start = f"{prefix}." if prefix else ""
    inside = [entry for entry in conversion["layers"] if entry["name"].startswith(start)]
    layers = [dict(entry, name=entry["name"][len(start):]) for entry in inside]
    return dict(conversion, layers=layers)
