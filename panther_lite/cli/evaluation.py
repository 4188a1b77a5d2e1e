"""The ``compress --eval`` options: the perplexity of the original checkpoint and of the
compressed output on a text file, both streamed block by block (never loaded whole), reported
in the summary, in ``evaluation.csv`` and in the report figure of OUT_DIR."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from ..conversion.workflows.compress import REPORT_PNG
from ..evaluation import DEFAULT_MAX_SEQ_LEN, Perplexity, perplexity
from .arguments import positive_int
from .checkpoint import CommandError

__all__ = ["add_evaluation_options", "Evaluation", "EVALUATION_CSV"]

EVALUATION_CSV = "evaluation.csv"


def add_evaluation_options(command) -> None:
    """Register ``--eval``, ``--eval-seq-len`` and ``--no-eval-original``."""
    group = command.add_argument_group("evaluation (perplexity, streamed block by block)")
    group.add_argument("--eval", type=Path, metavar="TEXT_FILE",
                       help="report the original's and the compressed model's perplexity on this UTF-8 text "
                            f"(summary, {EVALUATION_CSV}, report.png); causal language models only")
    group.add_argument("--eval-seq-len", type=positive_int, metavar="N",
                       help=f"tokens per evaluation window (default: the model's positions, at most {DEFAULT_MAX_SEQ_LEN})")
    group.add_argument("--no-eval-original", action="store_true",
                       help="with --eval, skip the original's perplexity (only the compressed model's)")


class Evaluation:
    """The perplexities one ``compress --eval`` run measures (none without ``--eval``, nor where
``measures`` is False: the ranks other than 0 across processes, whose options are still checked)."""

    def __init__(self, args: argparse.Namespace, say, measures: bool = True) -> None:
        self.path: Optional[Path] = args.eval
        self.seq_len, self.say, self.rows, self.measures = args.eval_seq_len, say, [], measures
        self.original = not args.no_eval_original
        if self.path is None and (args.eval_seq_len is not None or args.no_eval_original):
            raise CommandError("--eval-seq-len and --no-eval-original go with --eval TEXT_FILE")
        if self.path is not None:
            _check_text(self.path)

    def measure(self, label: str, directory: Path, quiet: bool) -> Optional[Perplexity]:
        """The perplexity of the checkpoint ``directory`` (streamed), recorded as ``label``."""
        if self.path is None or not self.measures or (label == "original" and not self.original):
            return None
        started = time.perf_counter()
        value = perplexity(directory, self.path, seq_len=self.seq_len, progress=not quiet)
        seconds = time.perf_counter() - started
        self.rows.append(dict(model=label, perplexity=float(value), nll=value.nll, tokens=value.tokens,
                              windows=value.windows, seq_len=value.seq_len, seconds=seconds, text=str(self.path)))
        self.say(f"perplexity of the {label} model on {self.path}: {float(value):.3f} ({value.tokens:,} tokens in "
                 f"{value.windows} windows of {value.seq_len}; {seconds:.1f} s)")
        return value

    def summary(self) -> str:
        """One line of the perplexities measured ("" when none)."""
        values = {row["model"]: row["perplexity"] for row in self.rows}
        if not values:
            return ""
        text = ", ".join(f"{label} {value:.3f}" for label, value in values.items())
        ratio = f" ({values['compressed'] / values['original']:.3f}x the original)" if len(values) == 2 else ""
        return f"perplexity on {self.path.name}: {text}{ratio}"

    def write(self, directory: Path, report, plot) -> None:
        """``evaluation.csv`` in ``directory``, and ``plot(report, path, title)`` redrawn with the perplexities."""
        if not self.rows:
            return
        import pandas as pd

        pd.DataFrame(self.rows).to_csv(directory / EVALUATION_CSV, index=False)
        plot(report, directory / REPORT_PNG, f"{report.attrs.get('summary', '')}; {self.summary()}")


def _check_text(path: Path) -> None:
    """CommandError naming ``--eval`` unless ``path`` is a readable, non-empty UTF-8 file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError(f"--eval {str(path)!r}: cannot be read as UTF-8 text: {error}") from None
    if not text.strip():
        raise CommandError(f"--eval {str(path)!r} holds no text")
