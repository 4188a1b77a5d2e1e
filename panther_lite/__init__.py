"""panther_lite: low-rank sketched layers for PyTorch (public API re-exports)."""
from __future__ import annotations

import importlib

from . import nn, sketch
from .conversion import (
    ConversionError,
    ConvertConfig,
    DistillConfig,
    RefineConfig,
    apply_conversion_config,
    compress_checkpoint,
    conversion_config,
    conversion_summary,
    convert,
    densify,
    distill,
    freeze,
    from_pretrained,
    plot_search,
    random_token_batches,
    register_kind,
    save_pretrained,
    teacher_outputs,
    TeacherOutputs,
    tune,
)
from .conversion.saving.hf_registration import install_transformers_plugin
from .evaluation import Perplexity, perplexity
from .nn import SKConv1d, SKConv2d, SKConv3d, SKExperts, SKLinear
from .version import __version__

__all__ = [
    "SKLinear",
    "SKConv1d",
    "SKConv2d",
    "SKConv3d",
    "SKExperts",
    "convert",
    "ConvertConfig",
    "RefineConfig",
    "DistillConfig",
    "register_kind",
    "densify",
    "distill",
    "teacher_outputs",
    "TeacherOutputs",
    "freeze",
    "tune",
    "plot_search",
    "random_token_batches",
    "save_pretrained",
    "from_pretrained",
    "compress_checkpoint",
    "perplexity",
    "Perplexity",
    "ConversionError",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
    "benchmark",
    "nn",
    "sketch",
    "__version__",
]

_LAZY_SUBMODULES = ("benchmark",)

# AutoModel*.from_pretrained of a panther_lite output builds its sketched layers (transformers' plugin)
install_transformers_plugin()


def __getattr__(name: str):
    # The measurement library needs pandas and matplotlib: import it only when asked for.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
