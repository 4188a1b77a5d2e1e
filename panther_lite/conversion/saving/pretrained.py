"""``save_pretrained``: a converted model saved so :func:`~panther_lite.from_pretrained`
(:mod:`~panther_lite.conversion.saving.loading`) rebuilds it exactly: the model's own files plus
its conversion config.

``save_pretrained(model, directory)`` writes what the model's own library writes (Hugging Face
``save_pretrained`` with safetensors, sentence-transformers' ``save``, or a safetensors
``state_dict`` for any other module) and ``panther_lite_config.json`` with the conversion
config; for Hugging Face models also in each ``config.json`` as its ``quantization_config``
(``"quant_method": "panther_lite"``, :mod:`.hf_quantizer`), so that after ``import panther_lite``
a plain ``AutoModel*.from_pretrained`` builds the sketched layers too, and with a guard that makes
transformers alone refuse it (:mod:`.hf_guard`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch.nn as nn

from ...extras import require
from ..deploy.quantized import check_storable, warn_if_quantized_beside
from .pretrained_format import (
    FORMAT, PRETRAINED_CONFIG_NAME, SENTENCE_TRANSFORMERS, STATE_DICT, TRANSFORMERS, VERSION, PathLike,
    hf_submodels, pretrained_model_class, sentence_transformer_classes,
)
from .hf_guard import guard_saved_configs
from .hf_recording import recorded_in_configs, save_recording_conversion
from .serialization import conversion_config
from .weight_files import WEIGHTS_NAME, writing

__all__ = ["save_pretrained", "PRETRAINED_CONFIG_NAME", "save_transformers_config", "write_pretrained_record"]


def _saved_with(model: nn.Module) -> str:
    pretrained = pretrained_model_class()
    if pretrained is not None and isinstance(model, pretrained):
        return TRANSFORMERS
    classes = sentence_transformer_classes()
    if classes and isinstance(model, classes):
        return SENTENCE_TRANSFORMERS
    # everything else, PEFT models included (PEFT's own save_pretrained keeps only the adapters)
    return STATE_DICT


def _check_layers_reloadable(model: nn.Module, conversion: Mapping) -> None:
    """sentence-transformers rebuilds its own modules (a ``Dense`` head, say) as dense ones, so
    only sketched layers inside its transformers model can be loaded back."""
    prefixes = [f"{prefix}." for prefix, _ in hf_submodels(model)]
    outside = [entry["name"] for entry in conversion["layers"] if not entry["name"].startswith(tuple(prefixes))]
    if outside:
        raise ValueError(
            f"sketched layers {outside[:5]} are outside the transformers model of this sentence-transformers "
            "model and could not be loaded back: densify them first (panther_lite.densify) or exclude them"
        )


def _write_model_files(model: nn.Module, saved_with: str, directory: Path, conversion: Mapping) -> None:
    if saved_with == STATE_DICT:
        save_model = require("safetensors.torch", "save_pretrained").save_model

        save_model(model, str(directory / WEIGHTS_NAME))
        return
    if saved_with == TRANSFORMERS:
        save_recording_conversion(model, str(directory))
        return
    with recorded_in_configs(model, conversion):
        model.save(str(directory))
    guard_saved_configs(directory)


def _move_into(source: Path, target: Path) -> None:
    """Move every file under ``source`` into ``target``, replacing files of the same name and
    leaving the other files of ``target`` (a tokenizer saved there, say) in place."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        destination = target / entry.name
        if entry.is_dir():
            _move_into(entry, destination)
        else:
            os.replace(entry, destination)


def write_pretrained_record(directory: Path, saved_with: str, conversion: Mapping) -> None:
    """``panther_lite_config.json``: how the files were written and the ``conversion`` config."""
    record = dict(format=FORMAT, version=VERSION, saved_with=saved_with, conversion=conversion)
    (directory / PRETRAINED_CONFIG_NAME).write_text(json.dumps(record, indent=2) + "\n")


def save_transformers_config(model: nn.Module, directory: Path, conversion: Mapping) -> None:
    """:func:`save_pretrained`'s files but the weights (written apart): ``config.json`` recording
    ``conversion``, and ``panther_lite_config.json``."""
    with recorded_in_configs(model, conversion):
        model.config.save_pretrained(str(directory))
    guard_saved_configs(directory)
    write_pretrained_record(directory, TRANSFORMERS, conversion)


def save_pretrained(model: nn.Module, directory: PathLike) -> None:
    """Save a (converted) model so :func:`from_pretrained` rebuilds it exactly.

    Writes the model's own files (transformers ``save_pretrained`` with safetensors,
    sentence-transformers ``save``, or ``model.safetensors`` with the ``state_dict``) and
    ``panther_lite_config.json`` (the :func:`~panther_lite.conversion_config`). Everything is
    written to a temporary directory inside ``directory`` first (so nothing is written next
    to it: its parent may be read-only) and then moved into place (``directory`` is created
    if needed; files already there under other names stay), so a failure while writing
    leaves it unchanged (a directory this call created is removed again).
    Frozen layers (:func:`~panther_lite.freeze`) are recorded and rebuilt frozen. A model
    holding quantized modules beside sketched layers gets a warning: the quantizer skipped
    them (freeze before quantizing). A ``state_dict`` holding what safetensors cannot store
    (quantized modules' packed weights) is a ValueError before anything is written.

    Args:
        model: any ``nn.Module``; a PEFT model is saved whole (base and adapters) as a state_dict.
        directory: where to save.

    Examples:
        See :func:`from_pretrained`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    directory = Path(directory)
    blocking = next((path for path in (directory, *directory.parents) if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        where = "exists and is not a directory" if blocking == directory else f"is inside {str(blocking)!r}, a file"
        raise ValueError(f"directory {str(directory)!r} {where}")
    saved_with = _saved_with(model)
    conversion = conversion_config(model)
    unfrozen = [entry["name"] for entry in conversion["layers"] if not entry.get("frozen", False)]
    warn_if_quantized_beside(model, unfrozen, "save_pretrained")
    check_storable(model, "save_pretrained")
    if saved_with == SENTENCE_TRANSFORMERS:
        _check_layers_reloadable(model, conversion)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    # staged inside the target (same filesystem for the renames; its parent may be read-only)
    staging = Path(tempfile.mkdtemp(prefix=".panther_lite_staging.", dir=directory))
    try:
        with writing(directory):
            _write_model_files(model, saved_with, staging, conversion)
            write_pretrained_record(staging, saved_with, conversion)
            _move_into(staging, directory)
    except BaseException:
        if created:  # nothing of this call is left behind
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
