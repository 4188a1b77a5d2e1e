"""panther_lite: low-rank sketched layers for PyTorch (public API re-exports)."""
from __future__ import annotations

import importlib

from . import nn, sketch
from .nn import SKConv2d, SKLinear
from .conversion import (
    ConversionError,
    apply_conversion_config,
    conversion_config,
    conversion_summary,
    convert,
    densify,
    from_pretrained,
    save_pretrained,
)
from .conversion.tune import tune

__version__ = "0.1.0"

__all__ = [
    "SKLinear",
    "SKConv2d",
    "convert",
    "densify",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
    "benchmark",
    "nn",
    "sketch",
    "__version__",
]

_LAZY_SUBMODULES = ("benchmark",)


def __getattr__(name: str):
    # The measurement library needs pandas and matplotlib: import it only when asked for.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
