"""Model surgery: replace a trained model's dense layers with fitted sketched layers, and back.

The workflows (``workflows``, on one shared setup step): :func:`convert` takes its options as a
:class:`ConvertConfig` (``config``), picks layers (``selection``) of the registered layer kinds
(``kinds``: each kind's description and its strategy, :func:`register_kind`), chooses a pipeline
(``pipelines``: the whole model at once, block by block, or out of core) that sizes them
(``planning``), records calibration statistics (``calibration``) and fits replacements
(``fitting``), swaps them in atomically (``surgery``), checks the result still runs
(``verification``) and reports (``report``, ``report_plot``); :func:`densify` undoes it;
:func:`compress_checkpoint` converts a checkpoint directory larger than memory, streamed block by
block; :func:`tune` finds the smallest budget within a tolerance of the dense score.
:func:`conversion_config` / :func:`apply_conversion_config` (``saving``) rebuild a converted
layout so its ``state_dict`` loads into a fresh copy of the dense model; :func:`save_pretrained`
/ :func:`from_pretrained` save and rebuild a converted model with its config; :func:`freeze`
(``deploy``) turns sketched layers into standard ones for deployment;
:func:`random_token_batches` adds a data-free prior over a language model's vocabulary to its
calibration batches; :func:`distill` (``distilling``) trains a converted model against the original, or against its outputs
cached once by :func:`teacher_outputs`.
"""
from ..figures import plot_search
from .calibration.random_tokens import random_token_batches
from .config import ConvertConfig, RefineConfig
from .deploy.freezing import freeze
from .distilling import DistillConfig, DistillationResult, TeacherOutputs, distill, teacher_outputs
from .kinds import (
    FrozenConv1d, FrozenConv2d, FrozenConv3d, FrozenExperts, FrozenLinear, LayerKind, LinearKind, register_kind,
)
from .pipelines import Pipeline
from .report import conversion_summary
from .saving.loading import from_pretrained
from .saving.pretrained import save_pretrained
from .saving.rebuilding import apply_conversion_config
from .saving.serialization import conversion_config
from .verification import ConversionError
from .workflows import compress_checkpoint, convert, densify, tune

__all__ = [
    "convert",
    "ConvertConfig",
    "RefineConfig",
    "densify",
    "freeze",
    "FrozenLinear",
    "FrozenConv1d",
    "FrozenConv2d",
    "FrozenConv3d",
    "FrozenExperts",
    "register_kind",
    "LayerKind",
    "LinearKind",
    "Pipeline",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
    "ConversionError",
    "save_pretrained",
    "from_pretrained",
    "compress_checkpoint",
    "tune",
    "plot_search",
    "random_token_batches",
    "distill",
    "DistillConfig",
    "DistillationResult",
    "teacher_outputs",
    "TeacherOutputs",
]
