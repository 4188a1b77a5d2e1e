"""The ``compress`` command's ``--distill`` step: the converted model trained against the
original (:func:`panther_lite.distill`), with its options and ``distillation.csv``.

The original model is the teacher, so with ``--distill`` the command holds two models: the
checkpoint is loaded whole (not streamed) and a copy of it taken before the conversion (and
only then), kept until the distillation ends, then released.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, List, Optional

import torch.nn as nn

from ..conversion import DistillConfig, distill
from ..conversion.distilling import DistillationResult
from ..conversion.pipelines.blocks import without_kv_cache
from .arguments import positive_float, positive_int
from .checkpoint import CommandError
from .config_options import Option, add_config_options, config_overrides

__all__ = ["DISTILLATION_CSV", "add_distill_options", "check_distill_options", "distiller", "run_distill"]

DISTILLATION_CSV = "distillation.csv"


DISTILL_OPTIONS = (
    Option("max_steps", positive_int, aliases=("--distill-steps",)), Option("lr", positive_float),
)


def add_distill_options(command: argparse.ArgumentParser) -> None:
    """``--distill`` and the :class:`~panther_lite.DistillConfig` fields it offers
    (``--distill-max-steps``, ``--distill-lr``) in their own group."""
    group = command.add_argument_group("distillation against the original (panther_lite.distill, DistillConfig's fields)")
    group.add_argument("--distill", action="store_true",
                       help="after the conversion, train the converted model's factors and biases to reproduce the "
                            "original model's outputs on the calibration batches (holds both models in memory); "
                            f"writes {DISTILLATION_CSV}")
    add_config_options(group, DistillConfig, DISTILL_OPTIONS, prefix="distill-")


def check_distill_options(args: argparse.Namespace) -> dict:
    """The :class:`~panther_lite.DistillConfig` fields the options set (CommandError for a setting
    without ``--distill``)."""
    settings = config_overrides(args, DISTILL_OPTIONS, prefix="distill-")
    if settings and not args.distill:
        raise CommandError("--distill-max-steps and --distill-lr set the distillation: add --distill")
    return settings


def distiller(args: argparse.Namespace, batches: List[dict], tokenizer, say) -> Optional[Callable]:
    """With ``--distill``, :func:`~panther_lite.compress_checkpoint`'s ``distill`` step (which
    keeps a copy of the loaded model as the teacher): :func:`run_distill` on the text
    ``batches``; else None (no second model)."""
    if not args.distill:
        return None
    return lambda model, teacher, directory: run_distill(model, teacher, batches, tokenizer, args, directory, say)


def run_distill(model: nn.Module, teacher: nn.Module, batches: List[dict], tokenizer, args: argparse.Namespace,
                staging: Path, say) -> DistillationResult:
    """``distill(model, teacher, batches)`` with the options (``--random-tokens N``: N random-token
    sequences of ``distill``'s length, drawn afresh for each pass), the key/value caches off; writes its
    history (``step, train_loss, held_loss``) to ``staging/distillation.csv``."""
    random = {"tokenizer": tokenizer, "random_tokens": args.random_tokens} if args.random_tokens else {}
    with without_kv_cache(model), without_kv_cache(teacher):
        result = distill(model, teacher, batches, progress=not args.quiet, **random, **check_distill_options(args))
    result.history_frame().to_csv(staging / DISTILLATION_CSV, index=False)
    say(f"distilled {result.steps} steps ({result.stop_reason}; kept step {result.best_step}): held-back loss "
        f"{result.loss_before:.4g} -> {result.loss_after:.4g} in {result.seconds:.1f} s")
    return result
