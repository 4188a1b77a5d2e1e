"""The ``compress`` command: convert a transformers checkpoint directory with
:func:`panther_lite.compress_checkpoint` (out of core: block by block, never the whole model in
memory), calibrated on a text file, into an output directory (model, tokenizer, report CSV and
plot) written all at once; ``--resume`` continues a run that was stopped; ``--distill`` trains
the result against the original's outputs, cached before the conversion (:mod:`.distilling`)."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..conversion import ConvertConfig, RefineConfig, random_token_batches
from ..conversion.config import ALLOCATIONS, SENSITIVITY_METRICS, device_problem
from ..conversion.distilling.distillation import RANDOM_TOKEN_LENGTH as DISTILL_RANDOM_TOKEN_LENGTH
from ..conversion.kinds import kind_of
from ..conversion.saving.checkpoint_files import CheckpointFiles
from ..conversion.workflows.compress import REFINEMENT_CSV, REPORT_CSV, REPORT_PNG, compress_checkpoint
from ..conversion.saving.staging import check_output_dir, staging_path
from ..extras import quiet_optional_imports, require
from ..nn.low_rank_fit import FIT_METHODS
from .arguments import DTYPES, positive_float, positive_int
from .config_options import Option, add_config_options, config_overrides
from .checkpoint import CommandError, calibration_batches, check_model_dir, load_tokenizer, read_samples, real_tokens
from .recipes import RECIPES, add_recipe_option
from .distilling import add_distill_options, check_distill_memory, check_distill_options, distiller
from .evaluation import Evaluation, add_evaluation_options
from .torchrun import across_processes, add_distributed_arguments, first_process, several_processes

__all__ = ["add_compress_command", "run_compress", "REPORT_CSV", "REPORT_PNG", "REFINEMENT_CSV"]

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


def _blocks(text: str):
    """``argparse`` type for ``--blocks``: "off" (or "none") is False, else "auto" or a dotted path."""
    return False if text.lower() in _NO_BLOCKS else text


CONVERT_OPTIONS = (
    Option("param_ratio", _ratio), Option("num_terms", positive_int), Option("low_rank", positive_int),
    Option("allocation", ALLOCATIONS), Option("sensitivity", SENSITIVITY_METRICS), Option("sequential", bool),
    Option("output_fisher", bool), Option("decomposition", FIT_METHODS, aliases=("--fit",)),
    Option("align", _alignment, metavar="auto|none|N"), Option("seed", int),
    Option("calibration_device", _device, metavar="DEVICE"), Option("blocks", _blocks, metavar="auto|off|PATH"),
)
REFINE_OPTIONS = (
    Option("max_steps", positive_int, aliases=("--refine-steps",)), Option("lr", positive_float),
)


def _add_selection_options(command) -> None:
    """Target/exclude options (PEFT's semantics), each a list of names or a regex."""
    selection = command.add_argument_group("layer selection (PEFT's semantics; exclusion wins)")
    targets = selection.add_mutually_exclusive_group()
    targets.add_argument("--target-modules", action="append", metavar="NAME",
                         help="a module name or dotted suffix, or all-linear; repeatable")
    targets.add_argument("--target-regex", metavar="REGEX", help="a regex full-matched against module names")
    excludes = selection.add_mutually_exclusive_group()
    excludes.add_argument("--exclude-modules", action="append", metavar="NAME",
                          help="a module name or dotted suffix; repeatable")
    excludes.add_argument("--exclude-regex", metavar="REGEX", help="a regex full-matched against module names")


def add_compress_command(subparsers) -> None:
    """Register ``compress`` and its options (they mirror :func:`panther_lite.convert`'s)."""
    command = subparsers.add_parser(
        "compress",
        help="compress a transformers checkpoint directory",
        description="Convert a transformers checkpoint with panther_lite.compress_checkpoint (block by block, never "
        "the whole model in memory), calibrated on a text file, and save the model, its tokenizer, report.csv and "
        "report.png into OUT_DIR (written all at once; --resume continues a stopped run).",
    )
    command.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a transformers save_pretrained directory")
    command.add_argument("--output", "-o", type=Path, required=True, metavar="OUT_DIR",
                         help="where to save; must not exist or be empty, unless --overwrite")
    command.add_argument("--calibration", type=Path, required=True, metavar="TEXT_FILE",
                         help="UTF-8 text, one calibration sample per line (blank lines skipped)")
    command.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    command.add_argument("--resume", action="store_true",
                         help="continue the run a stopped compress left beside OUT_DIR (.OUT_DIR.partial; same "
                              "MODEL_DIR, options and calibration) after its last block written; with none, start")
    command.add_argument("--in-memory", action="store_true",
                         help="load the whole model and convert it in memory (needs memory for the whole model and "
                              "more; by default it is read from MODEL_DIR one block at a time)")
    command.add_argument("--allow-missing-weights", action="store_true",
                         help="convert a checkpoint lacking some weights its config needs, those initialised at "
                              "random (listed in a warning; by default an error naming them)")
    command.add_argument("--quiet", "-q", action="store_true", help="no progress bars or step messages")
    add_recipe_option(command)
    data = command.add_argument_group("calibration batches")
    data.add_argument("--max-samples", type=positive_int, default=128, help="lines used (default 128)")
    data.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sample at most (default 256)")
    data.add_argument("--batch-size", type=positive_int, default=8, help="samples per batch (default 8)")
    data.add_argument("--random-tokens", type=positive_int, metavar="N",
                      help=f"append N sequences of {RANDOM_TOKEN_LENGTH} random vocabulary tokens: a data-free prior "
                           "over the vocabulary that keeps quality on text unlike the calibration file (256 is plenty); "
                           f"with --distill, the distillation adds N of its own ({DISTILL_RANDOM_TOKEN_LENGTH} tokens each, "
                           "drawn once and cached with the original's outputs)")
    data.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                      help="dtype the model is loaded and converted in (default: the checkpoint's)")
    sizes = command.add_argument_group("sizes, allocation and fits (panther_lite.ConvertConfig's fields)")
    add_config_options(sizes, ConvertConfig, CONVERT_OPTIONS)
    refine = command.add_argument_group("block-wise refinement (ConvertConfig.refine, RefineConfig's fields)")
    add_config_options(refine, ConvertConfig, (Option("refine", bool),))
    add_config_options(refine, RefineConfig, REFINE_OPTIONS, prefix="refine-")
    add_distill_options(command)
    add_evaluation_options(command)
    _add_selection_options(command)
    add_distributed_arguments(command)
    command.set_defaults(run=across_processes(run_compress))


def _selector(names: Optional[List[str]], regex: Optional[str]):
    if regex is not None:
        return regex
    return "all-linear" if names == ["all-linear"] else names


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    """The :class:`~panther_lite.ConvertConfig` the parsed options ask for."""
    options = config_overrides(args, CONVERT_OPTIONS)
    if "param_ratio" not in options and "low_rank" not in options:
        raise CommandError("give the size: --param-ratio R, or --low-rank K (with --num-terms L)")
    options.update(
        progress=not args.quiet,
        target_modules=_selector(args.target_modules, args.target_regex),
        exclude_modules=_selector(args.exclude_modules, args.exclude_regex),
    )
    settings = config_overrides(args, REFINE_OPTIONS, prefix="refine-")
    refine = config_overrides(args, (Option("refine", bool),)).get("refine", False)
    if settings and not refine:
        raise CommandError("--refine-max-steps and --refine-lr set block-wise refinement: add --refine")
    if refine:
        options["refine"] = settings or True
        if options.get("blocks") is False:
            raise CommandError("--refine refines block by block: it cannot be combined with --blocks off")
    if options.get("output_fisher") and several_processes():
        raise CommandError("--output-fisher (which --recipe causal-lm sets) measures the Fisher in one process: "
                           "add --no-output-fisher to compress across processes")
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
    widths = [(part.fan_in, name) for name, module in model.named_modules()
              if (kind := kind_of(module)) is not None and kind.linear
              for part in kind.record(name, module).parts]  # every kind's records: an experts module's projections too
    widest, name = max(widths, key=lambda width_name: width_name[0], default=(0, ""))  # the first widest
    if tokens < widest:
        print(f"warning: the calibration text has {tokens:,} tokens, fewer than the {widest:,} inputs of {name}: "
              f"layers that wide are fitted to the calibration text alone; give several times {widest:,} tokens",
              file=sys.stderr)


def _inputs(args: argparse.Namespace) -> dict:
    """What OUT_DIR must never be, hold or lie inside, by the name the messages give it."""
    inputs = {"MODEL_DIR": args.model_dir, "the calibration file": args.calibration}
    return inputs if args.eval is None else {**inputs, "the --eval file": args.eval}


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


def _say_refinement(report, say) -> None:
    """One line saying what refinement bought (the per-block errors are in ``refinement.csv``)."""
    rows = report.attrs.get("refinement") or []
    if rows:
        before = sum(row["error_before"] for row in rows) / len(rows)
        after = sum(row["error_after"] for row in rows) / len(rows)
        say(f"refined {len(rows)} blocks: mean held-back block output error {before:.4f} -> {after:.4f}")


@contextlib.contextmanager
def _warnings_on_one_line() -> Iterator[None]:
    """Warnings shown as ``warning: <message>`` on stderr for the duration."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _calibration(args: argparse.Namespace, tokenizer, files: CheckpointFiles, say) -> Tuple[list, list]:
    """``(text, batches)``: the calibration batches of the text file, and those with
    ``--random-tokens``' added, for MODEL_DIR's ``tokenizer``, capped at the positions of the
    model its config builds (on the meta device)."""
    samples = read_samples(args.calibration, args.max_samples)
    skeleton = files.skeleton(DTYPES.get(args.dtype))
    text = calibration_batches(samples, tokenizer, skeleton, args.seq_len, args.batch_size)
    batches = text + (_random_tokens(tokenizer, skeleton, args) if args.random_tokens else [])
    tokens = real_tokens(batches)
    _warn_if_few_tokens(skeleton, tokens)
    extra = f" and {args.random_tokens} random-token sequences" if args.random_tokens else ""
    say(f"compressing {type(skeleton).__name__} ({files.auto_class.__name__}) from {args.model_dir}; calibrating "
        f"on {len(samples)} samples{extra} ({tokens:,} tokens) in {len(batches)} batches")
    if files.auto_class.__name__ == "AutoModelForCausalLM" and args.recipe is None:
        say(f"a causal language model: --recipe causal-lm ({' '.join(RECIPES['causal-lm'])}) is the recipe "
            "measured for these (docs/evaluation.rst)")
    return text, batches


def _evaluate_output(evaluation: Evaluation, args: argparse.Namespace, report) -> None:
    """``--eval``: the compressed output's perplexity (streamed from OUT_DIR), written beside it and printed."""
    from ..conversion.report_plot import plot_conversion_report

    with quiet_optional_imports(), _warnings_on_one_line():
        evaluation.measure("compressed", args.output, args.quiet)
    evaluation.write(args.output, report, plot_conversion_report)
    if evaluation.summary():
        print(evaluation.summary(), flush=True)


def run_compress(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status. Bad input raises
    :class:`~panther_lite.cli.checkpoint.CommandError` (or the library's ValueError / TypeError /
    ConversionError) and leaves ``OUT_DIR`` as it was; a run stopped after it planned or wrote a
    block says where its work is kept for ``--resume``."""
    started = time.perf_counter()
    say = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    require("transformers", "the compress command")
    _check_paths(args)
    read_samples(args.calibration, args.max_samples)  # a bad calibration file fails before any model is read
    config = convert_config(args)
    check_distill_options(args)
    evaluation = Evaluation(args, say, measures=first_process())  # across processes: rank 0 alone
    with _transformers_bars(shown=not args.quiet), quiet_optional_imports(), _warnings_on_one_line():
        tokenizer = load_tokenizer(args.model_dir)
        files = CheckpointFiles(args.model_dir)
        distill_floor = check_distill_memory(files.skeleton(DTYPES.get(args.dtype)), config) if args.distill else 0
        text, batches = _calibration(args, tokenizer, files, say)
        if not several_processes():  # across processes, after the conversion: the others never wait for it
            evaluation.measure("original", args.model_dir, args.quiet)
        kept = staging_path(args.output)
        earlier = kept.is_dir() and not args.resume  # refused: the error says why
        try:
            distill = distiller(args, text, tokenizer, DTYPES.get(args.dtype), distill_floor, say)
            report = compress_checkpoint(
                args.model_dir, args.output, calibration_data=batches + distill.calibration, config=config,
                resume=args.resume, dtype=DTYPES.get(args.dtype), overwrite=args.overwrite, in_memory=args.in_memory,
                allow_missing_weights=args.allow_missing_weights, distill=distill.train,
            )
        except BaseException:
            if kept.is_dir() and not earlier:
                print(f"the work done so far is kept in {str(kept)!r}: run the same command with --resume to continue "
                      "it, or delete it", file=sys.stderr, flush=True)
            raise
        if several_processes():
            evaluation.measure("original", args.model_dir, args.quiet)
    say(f"converted in {time.perf_counter() - started:.1f} s ({report.attrs['pipeline']})")
    _say_refinement(report, say)
    if first_process():
        print(report.attrs["summary"], flush=True)
    _evaluate_output(evaluation, args, report)
    say(f"wrote {args.output} in {time.perf_counter() - started:.1f} s; load it with "
        f"panther_lite.from_pretrained({files.auto_class.__name__}, {str(args.output)!r})")
    return 0
