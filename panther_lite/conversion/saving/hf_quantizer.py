"""transformers' checkpoint-format plugin for panther_lite outputs: the ``"panther_lite"``
quantization config and quantizer, so ``AutoModel*.from_pretrained(out)`` builds the sketched
layers (on the meta device, before any weight is read) and loads the factors straight into them.

This module imports transformers and registers the plugin as it is imported:
:mod:`.hf_registration` imports it only once transformers' quantizer registry is loaded. A saved ``config.json`` carries::

    "quantization_config": {"quant_method": "panther_lite",
                            "conversion": {"format": "panther_lite.conversion", "version": 1,
                                           "layers": [{"name": "model.layers.0.self_attn.q_proj", ...}]}}

Example::

    import panther_lite, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out)   # sketched layers, saved factors
"""
from __future__ import annotations

from typing import Mapping, Optional

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .hf_guard import lift_guard
from .hf_recording import record_conversion_on_save
from .pretrained_format import QUANT_METHOD
from .serialization import CONFIG_FORMAT, swap_in_conversion

__all__ = ["QUANT_METHOD", "PantherLiteConfig", "PantherLiteHfQuantizer", "register"]


class PantherLiteConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a panther_lite output: its conversion config
    (:func:`~panther_lite.conversion_config`, names relative to the transformers model).

    Args:
        conversion: ``{"format": "panther_lite.conversion", "version": 1, "layers": [...]}``.
        quant_method: ``"panther_lite"`` (what ``config.json`` records; any other is a ValueError).

    Example::

        PantherLiteConfig(conversion=panther_lite.conversion_config(model)).to_dict()
        # {"quant_method": "panther_lite", "conversion": {...}}
    """

    def __init__(self, conversion: Optional[Mapping] = None, quant_method: str = QUANT_METHOD, **unknown):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if unknown:
            raise ValueError(f"quantization_config of panther_lite has unknown fields {sorted(unknown)}")
        if not isinstance(conversion, Mapping) or conversion.get("format") != CONFIG_FORMAT:
            raise ValueError(
                f"quantization_config['conversion'] must be a conversion config (format {CONFIG_FORMAT!r}), "
                f"got {type(conversion).__name__}"
            )
        self.quant_method = QUANT_METHOD
        self.conversion = dict(conversion)


class PantherLiteHfQuantizer(HfQuantizer):
    """Loads a panther_lite output: before the weights load, the layers the conversion config
    lists are swapped for sketched (or frozen) layers of the recorded sizes, on the meta device
    and in the model's dtype (:func:`~panther_lite.apply_conversion_config`); transformers then
    loads the saved factors into them as into any other parameter (``dtype``, ``device_map``,
    tied weights). Serializable and trainable: ``save_pretrained`` and training work on the
    loaded model. It only loads outputs (``requires_calibration``): passing a
    ``PantherLiteConfig`` to ``from_pretrained`` of a dense checkpoint is an error; compress
    with :func:`~panther_lite.convert` or :func:`~panther_lite.compress_checkpoint` instead.
    """

    requires_calibration = True
    quantization_config: PantherLiteConfig

    def validate_environment(self, *args, **kwargs) -> None:
        """Sketched layers are plain torch modules: every device and dtype works."""

    def update_attn_implementation(self, config):
        """The one hook that sees the config before the weights files are looked up: lift the
        guard (:mod:`.hf_guard`) so transformers finds the real ones."""
        lift_guard(config)
        return super().update_attn_implementation(config)

    def _process_model_before_weight_loading(self, model, **kwargs):
        swap_in_conversion(model, self.quantization_config.conversion)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """The loaded model's ``save_pretrained`` records its conversion and keeps the guard
        (:func:`.hf_recording.record_conversion_on_save`). Its parameters are ordinary floating
        tensors, so it is not marked quantized: transformers refuses ``.half()``/``.float()`` and
        the Trainer refuses fine-tuning without adapters on quantized models."""
        record_conversion_on_save(model)
        model.is_quantized = False
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Register :class:`PantherLiteConfig` and :class:`PantherLiteHfQuantizer` under
    ``"panther_lite"`` with transformers (once; later calls do nothing)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(PantherLiteConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(PantherLiteHfQuantizer)


register()
