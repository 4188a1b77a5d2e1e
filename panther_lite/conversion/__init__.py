"""Model surgery: replace a trained model's dense layers with fitted sketched layers, and back.

:func:`convert` picks layers (``selection``), sizes them (``planning``), records
calibration statistics (``calibration``), fits replacements (``fitting``), swaps
them in atomically (``surgery``), checks the result still runs (``verification``)
and reports (``report``); :func:`densify` undoes it; :func:`conversion_config` /
:func:`apply_conversion_config` (``serialization``) rebuild a converted layout so its
``state_dict`` loads into a fresh copy of the dense model; :func:`save_pretrained` /
:func:`from_pretrained` (``pretrained``) save and rebuild a converted model with its config;
and :func:`tune` (``tuning``) finds the smallest budget within a tolerance of the dense score;
:func:`freeze` (``freezing``) turns sketched layers into standard ones for deployment;
:func:`random_token_batches` (``random_tokens``) adds a data-free prior over a language
model's vocabulary to its calibration batches.
"""
from .api import convert, densify
from .distillation import DistillationResult, distill
from .freezing import FrozenConv1d, FrozenConv2d, FrozenConv3d, FrozenLinear, freeze
from .pretrained import from_pretrained, save_pretrained
from .random_tokens import random_token_batches
from .report import conversion_summary
from .serialization import apply_conversion_config, conversion_config
from .tuning import plot_search, tune
from .verification import ConversionError

__all__ = [
    "convert",
    "densify",
    "freeze",
    "FrozenLinear",
    "FrozenConv1d",
    "FrozenConv2d",
    "FrozenConv3d",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
    "ConversionError",
    "save_pretrained",
    "from_pretrained",
    "tune",
    "plot_search",
    "random_token_batches",
    "distill",
    "DistillationResult",
]
