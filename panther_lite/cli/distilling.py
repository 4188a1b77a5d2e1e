"""The ``compress`` command's ``--distill`` step: the converted model trained against the
original's outputs (:func:`panther_lite.distill`), with its options and ``distillation.csv``.

The original's outputs on the calibration text (its top ``--distill-top-k`` log-probabilities per
token) are cached before the conversion, streamed from MODEL_DIR block by block
(:func:`panther_lite.teacher_outputs`); the conversion then streams as without ``--distill``,
and the compressed model alone is loaded and trained against the cache, so the command never
holds the original whole, nor two models. Under ``torchrun`` each process caches the outputs of its
share of the batches (batch ``i`` on process ``i % world``) and trains on them; every process ends
with the one-process model, which rank 0 writes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from ..conversion import ConvertConfig, DistillConfig, TeacherOutputs, distill, teacher_outputs
from ..conversion.distilling import DistillationResult, sampled_batches, sampled_with_outputs
from ..conversion.distilling.config import TRAINABLE
from ..conversion.distilling.memory import check_training_memory, training_bytes
from ..conversion.fitting.autocast import AUTOCAST_CHOICES, resolve_autocast
from ..conversion.pipelines.blocks import without_kv_cache
from ..conversion.pipelines.streamed_model import streamed_model
from ..conversion.selection import select_layers
from .arguments import positive_float, positive_int
from .checkpoint import CommandError, real_tokens
from .config_options import Option, add_config_options, config_overrides

__all__ = ["DISTILLATION_CSV", "PreparedDistillation", "add_distill_options", "check_distill_options",
           "check_distill_memory", "distiller", "first_sequences", "run_distill", "sampling_dtype"]

DISTILLATION_CSV = "distillation.csv"
_STORED_AT_LEAST = 0.9  # of param_ratio: the least a uniform allocation stores where a rank step allows
SAMPLED_PREFIX = 16  # calibration tokens each --distill-generate sequence continues (half of shorter samples)


def _trained(text: str) -> Tuple[str, ...]:
    """``argparse`` type for ``--distill-train``: comma-separated names of :data:`TRAINABLE`."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(name in TRAINABLE for name in names):
        raise argparse.ArgumentTypeError(f"expected one or more of {','.join(TRAINABLE)}, comma-separated, got {text!r}")
    return names


DISTILL_OPTIONS = (
    Option("max_steps", positive_int, aliases=("--distill-steps",)),
    Option("max_minutes", positive_float, metavar="MINUTES"), Option("lr", positive_float),
    Option("top_k", positive_int), Option("train", _trained, metavar="factors,biases,norms"),
    Option("autocast", AUTOCAST_CHOICES),
)


def add_distill_options(command: argparse.ArgumentParser) -> None:
    """``--distill``, the :class:`~panther_lite.DistillConfig` fields it offers
    (``--distill-max-steps``, ``--distill-max-minutes``, ``--distill-lr``, ``--distill-top-k``, ``--distill-train``,
    ``--distill-autocast``), ``--distill-generate`` and ``--calibrate-generated`` in their own group."""
    group = command.add_argument_group("distillation against the original (panther_lite.distill, DistillConfig's fields)")
    group.add_argument("--distill", action=argparse.BooleanOptionalAction, default=None,
                       help="after the conversion, train the converted model's factors and biases to reproduce the "
                            "original model's outputs on the calibration batches (cached first, streamed from "
                            f"MODEL_DIR: the original is never whole in memory); writes {DISTILLATION_CSV}")
    add_config_options(group, DistillConfig, DISTILL_OPTIONS, prefix="distill-")
    group.add_argument("--distill-generate", type=positive_int, default=None, metavar="N",
                       help="also train on N sequences the original writes itself (sampled, streamed from MODEL_DIR, "
                            f"each continuing the first {SAMPLED_PREFIX} tokens of a calibration sample, as long as the calibration "
                            "batches): more text than the calibration holds, at one pass over the checkpoint per "
                            "generated token")
    group.add_argument("--calibrate-generated", type=positive_int, default=None, metavar="N",
                       help="let the first N of --distill-generate's sequences (all, if it samples fewer) also "
                            "calibrate the conversion (its fits, plan and output Fisher) beside the calibration text: "
                            "the fits then see what the original writes, not only the calibration samples; converting "
                            "takes longer in proportion to the tokens")


def check_distill_options(args: argparse.Namespace) -> dict:
    """The :class:`~panther_lite.DistillConfig` fields the options set (CommandError for a setting
    without ``--distill``; with ``--no-distill``, e.g. turning a recipe's distillation off, they
    are ignored)."""
    settings = config_overrides(args, DISTILL_OPTIONS, prefix="distill-")
    if (settings or args.distill_generate or args.calibrate_generated) and args.distill is None:
        raise CommandError("--distill-max-steps, --distill-max-minutes, --distill-lr, --distill-top-k, --distill-train, "
                           "--distill-autocast, --distill-generate and --calibrate-generated set the distillation: "
                           "add --distill")
    if args.distill and args.calibrate_generated and not args.distill_generate:
        raise CommandError(f"--calibrate-generated {args.calibrate_generated} takes the first of the sequences "
                           "--distill-generate N samples: add --distill-generate")
    return settings


def check_distill_memory(skeleton: nn.Module, config: ConvertConfig) -> int:
    """Refuse ``--distill`` before the calibration is read and anything converted when the converted model cannot
    even be held for training in this machine's memory: ``skeleton`` (the original on the meta
    device) with the layers ``config`` selects at :data:`_STORED_AT_LEAST` of its ``param_ratio``
    (their factors left out for ``--low-rank``), in float32, no element counted as trained (an
    estimate from below; :func:`~panther_lite.distill` checks the exact need before it trains).
    Returns that floor in bytes: memory the distillation holds anyway, which ``--distill-generate``'s
    sampling may fill with the original's blocks (:func:`distiller`)."""
    records = select_layers(skeleton, config.target_modules, config.exclude_modules, config.filter_fn)
    selected = sum(parameter.numel() for record in records for parameter in record.module.parameters())
    total = sum(parameter.numel() for parameter in skeleton.parameters())
    stored = total - selected + int(selected * _STORED_AT_LEAST * (config.param_ratio or 0.0))
    check_training_memory(stored, 0, "--distill",
                          "leave --distill out (--no-distill after --recipe), or compress on a machine with more memory")
    return training_bytes(stored, 0)


def sampling_dtype(autocast, dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the original samples ``--distill-generate``'s sequences in on the CPU: bfloat16 when the
    student trains under a bfloat16 autocast there (``--distill-autocast``: the sequences are only the
    text trained on, the original's cached outputs on them stay in ``dtype``), else ``dtype``. float16
    is not used: on a CPU it is neither native nor wide enough for every model's activations."""
    if resolve_autocast(autocast, torch.device("cpu")) == torch.bfloat16:
        return torch.bfloat16
    return dtype


def _with_samples(args: argparse.Namespace, batches: List[dict], dtype, config: DistillConfig, resident_bytes: int,
                  say) -> Tuple[List[dict], Optional[list]]:
    """``batches`` and, with ``--distill-generate N``, N sequences the original samples (streamed
    from MODEL_DIR in :func:`sampling_dtype`, its blocks kept in memory once read while they total
    at most ``resident_bytes``; every process draws the same ones) as long as the widest
    calibration batch, each continuing the first :data:`SAMPLED_PREFIX` tokens of a sample (half of
    them, for calibration batches shorter than twice that); and, when it samples in ``dtype``, the
    original's outputs on each batch kept from those very forwards (None for the calibration
    batches: ``teacher_outputs``'s ``known``), else None."""
    if not args.distill_generate:
        return batches, None
    length = max(batch["input_ids"].shape[1] for batch in batches)
    prefix = min(SAMPLED_PREFIX, length // 2)
    if not prefix:
        raise CommandError("--distill-generate continues the first tokens of a calibration sample, and the calibration "
                           "samples hold one token each: give longer samples")
    started = time.perf_counter()
    sampling = sampling_dtype(config.autocast, dtype)
    options = {"prefix": prefix, "batch_size": batches[0]["input_ids"].shape[0]}
    with streamed_model(args.model_dir, sampling, resident_bytes=resident_bytes) as teacher:
        if sampling == dtype:
            sampled, known = sampled_with_outputs(teacher, batches, args.distill_generate, length, config, **options)
            known = [None] * len(batches) + known
        else:
            sampled = sampled_batches(teacher, batches, args.distill_generate, length, progress=config.progress,
                                      **options)
            known = None
    say(f"sampled {args.distill_generate} sequences of {length} tokens from the original in "
        f"{time.perf_counter() - started:.1f} s{' (bfloat16)' if sampling == torch.bfloat16 else ''}"
        f"{', keeping its outputs on them' if known else ''}")
    return batches + sampled, known


def first_sequences(batches: List[dict], count: int) -> List[dict]:
    """The first ``count`` rows of ``batches`` (dicts of tensors, rows first), batched as they were.

    Examples:
        >>> rows = [{"input_ids": torch.zeros(8, 4)}, {"input_ids": torch.ones(8, 4)}]
        >>> [batch["input_ids"].shape[0] for batch in first_sequences(rows, 11)]
        [8, 3]
    """
    kept, left = [], count
    for batch in batches:
        if left <= 0:
            break
        rows = min(left, batch["input_ids"].shape[0])
        kept.append({key: value[:rows] for key, value in batch.items()})
        left -= rows
    return kept


class PreparedDistillation(NamedTuple):
    """What :func:`distiller` prepares: ``train(model, directory)``, the ``distill`` step of
    :func:`~panther_lite.compress_checkpoint` (None without ``--distill``), and ``calibration``,
    the sampled batches that also calibrate the conversion (``--calibrate-generated``)."""

    train: Optional[Callable]
    calibration: List[dict]


def distiller(args: argparse.Namespace, batches: List[dict], tokenizer, dtype, resident_bytes: int,
              say) -> PreparedDistillation:
    """With ``--distill``, :func:`~panther_lite.compress_checkpoint`'s ``distill`` step: the
    original's outputs on the text ``batches`` (with ``--distill-generate N``, N sequences it
    samples, its blocks kept in memory while they total at most ``resident_bytes``: the floor
    :func:`check_distill_memory` returns, which the distillation holds anyway; their outputs
    kept as it samples them where it samples in ``dtype``; and
    ``--random-tokens N`` random-token sequences of ``distill``'s length, drawn once) cached now,
    streamed from MODEL_DIR in ``dtype``, and :func:`run_distill` against them, with the first
    ``--calibrate-generated`` sampled sequences for the conversion's calibration."""
    if not args.distill:
        return PreparedDistillation(None, [])
    random = {"tokenizer": tokenizer, "random_tokens": args.random_tokens} if args.random_tokens else {}
    config = DistillConfig(progress=not args.quiet, **random, **check_distill_options(args))
    data, known = _with_samples(args, batches, dtype, config, resident_bytes, say)
    calibration = first_sequences(data[len(batches):], args.calibrate_generated or 0)
    if calibration:
        rows = sum(batch["input_ids"].shape[0] for batch in calibration)
        say(f"the first {rows} of them also calibrate the conversion ({real_tokens(calibration):,} tokens)")
    started = time.perf_counter()
    cached = teacher_outputs(args.model_dir, data, config, dtype=dtype, known=known)
    say(f"cached the original's outputs on {len(cached)} batches ({cached.nbytes / 2**20:.1f} MiB, top "
        f"{config.top_k} log-probabilities per token) in {time.perf_counter() - started:.1f} s")

    def train(model: nn.Module, directory: Optional[Path]) -> DistillationResult:
        return run_distill(model, cached, data, config, directory, say)

    return PreparedDistillation(train, calibration)


def run_distill(model: nn.Module, cached: TeacherOutputs, batches: List[dict], config: DistillConfig,
                staging: Optional[Path], say) -> DistillationResult:
    """``distill(model, cached, batches, config)`` with the key/value cache off (under ``torchrun``
    across the processes, each with its share of the cache); writes its history (``step,
    train_loss, held_loss``) to ``staging/distillation.csv`` (rank 0's: None on the others)."""
    with without_kv_cache(model):
        result = distill(model, cached, batches, config)
    if staging is not None:
        result.history_frame().to_csv(staging / DISTILLATION_CSV, index=False)
    say(f"distilled {result.steps} steps ({result.stop_reason}; kept step {result.best_step}): held-back loss "
        f"{result.loss_before:.4g} -> {result.loss_after:.4g} in {result.seconds:.1f} s")
    return result
