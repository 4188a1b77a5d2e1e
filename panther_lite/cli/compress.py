"""The ``compress`` command: convert a transformers checkpoint directory with
:func:`panther_lite.convert`, calibrated on a text file (optionally distil it against the
original, :mod:`.distilling`), and save the result (model, tokenizer, report CSV and plot)
into an output directory written all at once."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import torch
import torch.nn as nn

from ..conversion import ConvertConfig, convert, random_token_batches, save_pretrained
from ..conversion.config import ALLOCATIONS, device_problem
from ..conversion.fitting.block_refinement import REFINEMENT_COLUMNS
from ..conversion.kinds import kind_of
from ..conversion.pipelines.blocks import without_kv_cache
from ..extras import quiet_optional_imports, require
from ..nn.low_rank_fit import FIT_METHODS
from .arguments import DTYPES, positive_float, positive_int
from .checkpoint import CommandError, calibration_batches, check_model_dir, load_checkpoint, read_samples
from .distilling import add_distill_options, check_distill_options, original_if_distilling, run_distill
from .report_plot import plot_conversion_report
from .staging import check_output_dir, staged_directory

__all__ = ["add_compress_command", "run_compress", "REPORT_CSV", "REPORT_PNG", "REFINEMENT_CSV"]

REPORT_CSV, REPORT_PNG, REFINEMENT_CSV = "report.csv", "report.png", "refinement.csv"
_NO_BLOCKS = ("off", "none")
RANDOM_TOKEN_LENGTH = 16  # tokens in each --random-tokens sequence


def _ratio(text: str) -> float:
    """``argparse`` type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _alignment(text: str):
    """``argparse`` type for ``--align``: "auto", "none" (no rounding) or a multiple >= 1."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or an integer >= 1, got {text!r}") from None


def _device(text: str) -> str:
    """``argparse`` type for ``--calibration-device``: a torch device this machine has."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") from None
    problem = device_problem(device)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def add_compress_command(subparsers) -> None:
    """Register ``compress`` and its options (they mirror :func:`panther_lite.convert`'s)."""
    command = subparsers.add_parser(
        "compress",
        help="compress a transformers checkpoint directory",
        description="Convert a transformers checkpoint with panther_lite.convert, calibrated on a text file, and "
        "save the model, its tokenizer, report.csv and report.png into OUT_DIR (written all at once).",
    )
    command.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a transformers save_pretrained directory")
    command.add_argument("--output", "-o", type=Path, required=True, metavar="OUT_DIR",
                         help="where to save; must not exist or be empty, unless --overwrite")
    command.add_argument("--calibration", type=Path, required=True, metavar="TEXT_FILE",
                         help="UTF-8 text, one calibration sample per line (blank lines skipped)")
    command.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    command.add_argument("--quiet", "-q", action="store_true", help="no progress bars or step messages")
    data = command.add_argument_group("calibration batches")
    data.add_argument("--max-samples", type=positive_int, default=128, help="lines used (default 128)")
    data.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sample at most (default 256)")
    data.add_argument("--batch-size", type=positive_int, default=8, help="samples per batch (default 8)")
    data.add_argument("--random-tokens", type=positive_int, metavar="N",
                      help=f"append N sequences of {RANDOM_TOKEN_LENGTH} random vocabulary tokens: a data-free prior "
                           "over the vocabulary that keeps quality on text unlike the calibration file (256 is plenty)")
    data.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                      help="dtype the model is loaded and converted in (default: the checkpoint's)")
    sizes = command.add_argument_group("sizes and allocation (panther_lite.convert's arguments)")
    sizes.add_argument("--param-ratio", type=_ratio, help="stored size as a fraction of dense, in (0, 1]")
    sizes.add_argument("--num-terms", type=positive_int, help="L for every layer (default 1 with --param-ratio)")
    sizes.add_argument("--low-rank", type=positive_int, help="k for every layer")
    sizes.add_argument("--allocation", choices=ALLOCATIONS, default="uniform",
                       help="uniform: --param-ratio per layer; global: one budget for all layers")
    sizes.add_argument("--sequential", action="store_true",
                       help="fit layers in model order to the original outputs from the compressed inputs")
    sizes.add_argument("--fit", choices=FIT_METHODS, default="auto", help="the fits' decomposition")
    sizes.add_argument("--align", type=_alignment, default="auto", help="low_rank rounding: auto, none or a multiple")
    sizes.add_argument("--seed", type=int, help="seed of the randomized fits")
    sizes.add_argument("--calibration-device", type=_device, metavar="DEVICE",
                       help="where calibration statistics live (e.g. cuda:0)")
    sizes.add_argument("--blocks", metavar="auto|off|PATH",
                       help="block-by-block conversion: auto-detect, off, or the dotted path of the block list "
                            "(needs a panther_lite whose convert takes blocks)")
    refine = command.add_argument_group("block-wise refinement (convert's refine; needs the block pipeline)")
    refine.add_argument("--refine", action="store_true",
                        help="after each block's fits, Adam steps so it reproduces the original block's outputs")
    refine.add_argument("--refine-steps", type=positive_int, help="most Adam steps per block (default 100)")
    refine.add_argument("--refine-lr", type=positive_float, help="Adam's learning rate (default 1e-3)")
    add_distill_options(command)
    selection = command.add_argument_group("layer selection (PEFT's semantics; exclusion wins)")
    targets = selection.add_mutually_exclusive_group()
    targets.add_argument("--target-modules", action="append", metavar="NAME",
                         help="a module name or dotted suffix, or all-linear; repeatable")
    targets.add_argument("--target-regex", metavar="REGEX", help="a regex full-matched against module names")
    excludes = selection.add_mutually_exclusive_group()
    excludes.add_argument("--exclude-modules", action="append", metavar="NAME",
                          help="a module name or dotted suffix; repeatable")
    excludes.add_argument("--exclude-regex", metavar="REGEX", help="a regex full-matched against module names")
    command.set_defaults(run=run_compress)


def _selector(names: Optional[List[str]], regex: Optional[str]):
    if regex is not None:
        return regex
    return "all-linear" if names == ["all-linear"] else names


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    """The :class:`~panther_lite.ConvertConfig` the parsed options ask for."""
    if args.param_ratio is None and args.low_rank is None:
        raise CommandError("give the size: --param-ratio R, or --low-rank K (with --num-terms L)")
    options = dict(
        param_ratio=args.param_ratio, num_terms=args.num_terms, low_rank=args.low_rank,
        allocation=args.allocation, sequential=args.sequential, fit=args.fit, align=args.align, seed=args.seed,
        calibration_device=args.calibration_device, progress=not args.quiet,
        target_modules=_selector(args.target_modules, args.target_regex),
        exclude_modules=_selector(args.exclude_modules, args.exclude_regex),
    )
    settings = {"max_steps": args.refine_steps, "lr": args.refine_lr}
    settings = {name: value for name, value in settings.items() if value is not None}
    if settings and not args.refine:
        raise CommandError("--refine-steps and --refine-lr set block-wise refinement: add --refine")
    if args.refine:
        options["refine"] = settings or True
        if args.blocks is not None and args.blocks.lower() in _NO_BLOCKS:
            raise CommandError("--refine refines block by block: it cannot be combined with --blocks off")
    if args.blocks is not None:
        options["blocks"] = False if args.blocks.lower() in _NO_BLOCKS else args.blocks
    return ConvertConfig(**options)


@contextlib.contextmanager
def _transformers_bars(shown: bool) -> Iterator[None]:
    """transformers' own progress bars (loading, saving) hidden unless ``shown``, then restored."""
    transformers_logging = require("transformers.utils.logging", "the compress command")

    enabled = transformers_logging.is_progress_bar_enabled()
    if not shown:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _warn_if_few_tokens(model: nn.Module, tokens: int) -> None:
    """Whitened fits see only the input directions the calibration tokens span: with fewer
    tokens than a layer has inputs, its fit matches the calibration text and little else."""
    widths = [(kind.weight_matrix(module).shape[1], name) for name, module in model.named_modules()
              if (kind := kind_of(module)) is not None and kind.linear]
    widest, name = max(widths, key=lambda width_name: width_name[0], default=(0, ""))  # the first widest
    if tokens < widest:
        print(f"warning: the calibration text has {tokens:,} tokens, fewer than the {widest:,} inputs of {name}: "
              f"layers that wide are fitted to the calibration text alone; give several times {widest:,} tokens",
              file=sys.stderr)


def _inputs(args: argparse.Namespace) -> dict:
    """What OUT_DIR must never be, hold or lie inside, by the name the messages give it."""
    return {"MODEL_DIR": args.model_dir, "the calibration file": args.calibration}


def _check_paths(args: argparse.Namespace) -> None:
    check_model_dir(args.model_dir)
    check_output_dir(args.output, args.overwrite, _inputs(args))


def _random_tokens(tokenizer, model: nn.Module, args: argparse.Namespace) -> List[dict]:
    """``--random-tokens`` batches; a count or length the model or the machine cannot take is
    an error naming the option."""
    try:
        return random_token_batches(tokenizer, args.random_tokens, RANDOM_TOKEN_LENGTH, batch_size=args.batch_size,
                                    model=model)
    except ValueError as error:
        raise CommandError(f"--random-tokens {args.random_tokens}: {error}") from None


def _plot_report(report, path: Path, title: str) -> None:
    """``report.png``, or a warning when matplotlib (the ``[bench]`` extra) is missing: the
    model is what the user waited for, and is written without its plot."""
    try:
        plot_conversion_report(report, path, title=title)
    except ModuleNotFoundError as error:
        if not str(error.name).startswith("matplotlib"):
            raise
        print(f"warning: {path.name} not written: {error}", file=sys.stderr)


def _save_refinement(rows: List[dict], path: Path, say) -> None:
    """The per-block refinement errors as CSV, and one line saying what refinement bought."""
    import pandas as pd

    pd.DataFrame(rows, columns=REFINEMENT_COLUMNS).to_csv(path, index=False)
    if rows:
        before = sum(row["error_before"] for row in rows) / len(rows)
        after = sum(row["error_after"] for row in rows) / len(rows)
        say(f"refined {len(rows)} blocks: mean held-back block output error {before:.4f} -> {after:.4f}")


def run_compress(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status. Bad input raises
    :class:`~panther_lite.cli.checkpoint.CommandError` (or convert's ValueError / TypeError /
    ConversionError) and leaves ``OUT_DIR`` as it was."""
    started = time.perf_counter()
    say = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    require("transformers", "the compress command")
    _check_paths(args)
    samples = read_samples(args.calibration, args.max_samples)
    config = convert_config(args)
    check_distill_options(args)
    staging_directory = staged_directory(args.output, args.overwrite, _inputs(args))
    with _transformers_bars(shown=not args.quiet), staging_directory as staging:
        with quiet_optional_imports():  # transformers may import torchao while loading
            model, tokenizer, auto_class = load_checkpoint(args.model_dir, DTYPES.get(args.dtype))
        text = calibration_batches(samples, tokenizer, model, args.seq_len, args.batch_size)
        batches = text + (_random_tokens(tokenizer, model, args) if args.random_tokens else [])
        tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
        _warn_if_few_tokens(model, tokens)
        extra = f" and {args.random_tokens} random-token sequences" if args.random_tokens else ""
        say(f"loaded {type(model).__name__} ({auto_class.__name__}) from {args.model_dir}; calibrating on "
            f"{len(samples)} samples{extra} ({tokens:,} tokens) in {len(batches)} batches")
        teacher = original_if_distilling(model, args)
        with without_kv_cache(model):
            report = convert(model, config=config, calibration_data=batches)
        pipeline = f" ({report.attrs['pipeline']})" if "pipeline" in report.attrs else ""  # where convert reports it
        say(f"converted in {time.perf_counter() - started:.1f} s{pipeline}")
        if teacher is not None:
            run_distill(model, teacher, text, tokenizer, args, staging, say)  # it draws its own random tokens
            del teacher
        save_pretrained(model, staging)
        tokenizer.save_pretrained(str(staging))
        report.to_csv(staging / REPORT_CSV, index=False)
        if "refinement" in report.attrs:
            _save_refinement(report.attrs["refinement"], staging / REFINEMENT_CSV, say)
        model_name = Path(os.path.abspath(args.model_dir)).name
        _plot_report(report, staging / REPORT_PNG, title=f"{model_name}: {report.attrs['summary']}")
    print(report.attrs["summary"], flush=True)
    say(f"wrote {args.output} in {time.perf_counter() - started:.1f} s; load it with "
        f"panther_lite.from_pretrained({auto_class.__name__}, {str(args.output)!r})")
    return 0
