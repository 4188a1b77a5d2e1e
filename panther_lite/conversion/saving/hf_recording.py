"""What a transformers model holding sketched layers writes when transformers saves it: its
conversion as ``config.json``'s ``quantization_config`` (:mod:`.hf_quantizer`) and the guard
(:mod:`.hf_guard`), whether ``panther_lite.save_pretrained`` or transformers' own
``model.save_pretrained`` (``Trainer``, ``push_to_hub``, sentence-transformers' ``save``) saves it.

:func:`~panther_lite.convert` and the plugin's loading call :func:`record_conversion_on_save`, so
the model's own ``save_pretrained`` records the conversion the model holds *when it is saved*
(a later :func:`~panther_lite.freeze` is recorded too); :func:`~panther_lite.densify` calls
:func:`forget_conversion_on_save`, so the dense model saves as a plain transformers model again.

Example::

    panther_lite.convert(model, param_ratio=0.5, calibration_data=batches)  # a LlamaForCausalLM
    model.save_pretrained(out)   # config.json: quantization_config panther_lite + the guard
    AutoModelForCausalLM.from_pretrained(out)   # after import panther_lite: the converted model
    # without panther_lite: ValueError "... panther_lite output: import panther_lite ..."
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Mapping

import torch.nn as nn

from .hf_guard import guard_saved_configs
from .hf_registration import transformers_plugin
from .pretrained_format import QUANT_METHOD, QUANTIZATION_KEY, hf_submodels, relative_config
from .serialization import conversion_config, own_names_for_experts

__all__ = ["recorded_in_configs", "save_recording_conversion", "record_conversion_on_save", "forget_conversion_on_save"]


@contextlib.contextmanager
def recorded_in_configs(model: nn.Module, conversion: Mapping) -> Iterator[None]:
    """Set ``config.quantization_config`` (panther_lite's, :mod:`.hf_quantizer`) on each
    transformers model inside ``model`` for as long as it is being saved, then put the configs
    back as they were."""
    configs = [(sub.config, relative_config(conversion, prefix)) for prefix, sub in hf_submodels(model)]
    previous = [config.__dict__.get(QUANTIZATION_KEY) for config, _ in configs]
    try:
        for config, relative in configs:
            config.quantization_config = transformers_plugin().PantherLiteConfig(conversion=relative)
        yield
    finally:
        for (config, _), old in zip(configs, previous):
            if old is None:
                config.__dict__.pop(QUANTIZATION_KEY, None)
            else:
                config.quantization_config = old


def save_recording_conversion(model: nn.Module, save_directory, *args, **kwargs):
    """transformers' ``save_pretrained`` of ``model`` (its class's; the same arguments), with the
    conversion it holds now in ``config.json`` and the guard after it. Returns what it returns."""
    kwargs = {**own_names_for_experts(model), **kwargs}
    with recorded_in_configs(model, conversion_config(model)):
        result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    guard_saved_configs(Path(save_directory))
    return result


class _RecordingSave:
    """``model.save_pretrained`` of one model instance: :func:`save_recording_conversion`. A plain
    object (not a bound method), so the model still pickles and deep-copies (the copy's save is
    bound to the copy)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        return save_recording_conversion(self.model, save_directory, *args, **kwargs)


def record_conversion_on_save(model: nn.Module) -> None:
    """Make ``save_pretrained`` of each transformers model inside ``model`` (itself included)
    record its conversion and the guard; nothing when ``model`` holds no transformers model."""
    for _, sub in hf_submodels(model):
        sub.save_pretrained = _RecordingSave(sub)


def forget_conversion_on_save(model: nn.Module) -> None:
    """Undo :func:`record_conversion_on_save` and what the plugin's loading set (the config's
    panther_lite ``quantization_config``, the model's ``hf_quantizer``): ``model`` saves and
    reloads as a plain transformers model."""
    for _, sub in hf_submodels(model):
        if isinstance(sub.__dict__.get("save_pretrained"), _RecordingSave):
            del sub.save_pretrained
        if _is_panther_lite(sub.config.__dict__.get(QUANTIZATION_KEY)):
            del sub.config.quantization_config
        if _is_panther_lite(getattr(getattr(sub, "hf_quantizer", None), "quantization_config", None)):
            sub.hf_quantizer = None


def _is_panther_lite(quantization_config) -> bool:
    """Whether a ``quantization_config`` (a config object or its dict) is panther_lite's."""
    if isinstance(quantization_config, Mapping):
        return quantization_config.get("quant_method") == QUANT_METHOD
    return getattr(quantization_config, "quant_method", None) == QUANT_METHOD
