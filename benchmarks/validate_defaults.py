"""Defaults chosen on validation text that no benchmark evaluates on, so that choosing them
is not tuning on the benchmarks' test sentences.

The validation text: the 78 sentences of ``benchmarks/data/validation_sentences.txt`` (in
domain: written for this like ``natural_sentences.txt``, none shared with it) and the standard-
library docstring sentences 768 to 1023 (out of domain; ``bench_svd_llm.py`` evaluates on the
first 200, ``bench_compression.py`` and ``bench_distill.py`` calibrate on the first 256 and
evaluate on the next 256). Mean cosine of all-MiniLM-L6-v2's sentence embeddings to the
original's, all 36 encoder linear layers converted.

``validation_shrinkage.csv`` / ``.png``
    ``shrinkage="auto"`` with each share of its held-back strength
    (``panther_lite.conversion.calibration.shrinkage.AUTO_FRACTION``), uniform ranks at R = 0.3
    and 0.5, calibrated as ``bench_svd_llm.py`` does (its first 40 sentences), beside SVD-LLM at
    the same ranks. The default is the largest share that keeps the uniform fits within 0.002
    of SVD-LLM in and out of domain at both ratios.
``validation_distill_length.csv`` / ``.png``
    ``distill``'s ``random_token_length`` (the ordinary tokens in each random sequence): the
    target recipe of ``bench_distill.py`` (``global+random tokens`` at R = 0.5 on its 54
    natural sentences), then distilled on the same text and 256 random sequences of each
    length. The default is the length with the best out-of-domain cosine whose in-domain
    cosine is within 0.002 of the previous default's (16 tokens).

    python benchmarks/validate_defaults.py --output-dir benchmarks/results/cpu   # ~30 min, one thread
    python benchmarks/validate_defaults.py --only shrinkage                      # ~3 min
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import panther_lite  # noqa: E402
from bench_compression import (  # noqa: E402
    NATURAL_SENTENCES, _docstring_sentences, _load_minilm, _mean_cosine, _text_sources,
)
from bench_distill import RANDOM_TOKENS, TARGET_RECIPE, _converted, _tokenized  # noqa: E402
from bench_svd_llm import CALIBRATION, _batches, _ours, _svd_llm, plot  # noqa: E402
from panther_lite.benchmark import device_name  # noqa: E402
from panther_lite.conversion.calibration import shrinkage  # noqa: E402

VALIDATION_SENTENCES = Path(__file__).resolve().parent / "data" / "validation_sentences.txt"
DOCSTRINGS = slice(768, 1024)
RATIOS = (0.3, 0.5)
FRACTIONS = (1.0, 0.5, 0.25, 0.0)
PARTS = ("shrinkage", "distill_length")
DISTILL_RATIO = 0.5
DISTILL_LENGTHS = (16, 8, 6, 4, 2, 1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    return parser.parse_args(argv)


def _lines(path: Path) -> list:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


class Validation:
    """The model, its tokenizer and the validation text with the original's embeddings of it."""

    def __init__(self) -> None:
        self.model = _load_minilm()
        self.text = {
            "in_domain": _lines(VALIDATION_SENTENCES),
            "out_of_domain": _docstring_sentences(DOCSTRINGS.stop)[DOCSTRINGS],
        }
        self.references = {name: self.model.encode(text, convert_to_tensor=True, batch_size=64) for name, text in self.text.items()}

    def row(self, converted, **columns) -> dict:
        cosines = {name: _mean_cosine(converted, text, self.references[name]) for name, text in self.text.items()}
        row = dict(columns, **cosines)
        print(row, flush=True)
        return row


def shrinkage_rows(validation: Validation) -> list:
    """Uniform fits at each share of the auto strength, and SVD-LLM at their ranks."""
    batches = _batches(validation.model.tokenizer, _lines(NATURAL_SENTENCES)[:CALIBRATION])
    rows, default = [], shrinkage.AUTO_FRACTION
    for ratio in RATIOS:
        for fraction in FRACTIONS:
            shrinkage.AUTO_FRACTION = fraction
            try:
                converted, report = _ours(validation.model, batches, ratio, {})
            finally:
                shrinkage.AUTO_FRACTION = default
            rows.append(validation.row(converted, version="validation text", param_ratio=ratio,
                                       method=f"uniform, auto × {fraction:g}"))
        done = report[report["status"] == "converted"]
        ranks = {name: 2 * int(t) * int(k) for name, t, k in zip(done["name"], done["num_terms"], done["low_rank"])}
        rows.append(validation.row(_svd_llm(validation.model, batches, ranks), version="validation text", param_ratio=ratio,
                                   method="SVD-LLM"))
    return rows


def distill_length_rows(validation: Validation) -> list:
    """``bench_distill.py``'s target recipe at R = 0.5, then ``distill`` with random sequences
    of each length in ``DISTILL_LENGTHS``, each from the same conversion."""
    sources, sizes = _text_sources(quick=False)
    text = _tokenized(validation.model.tokenizer, sources["natural"][: sizes["natural"]])
    converted, _ = _converted(validation.model, text, TARGET_RECIPE, DISTILL_RATIO, RANDOM_TOKENS)
    common = dict(version="validation text", param_ratio=DISTILL_RATIO)
    rows = [validation.row(converted, **common, method=TARGET_RECIPE)]
    for length in DISTILL_LENGTHS:
        student = copy.deepcopy(converted)
        result = panther_lite.distill(
            student[0].auto_model, validation.model[0].auto_model, text, tokenizer=validation.model.tokenizer,
            random_tokens=RANDOM_TOKENS, random_token_length=length, progress=False,
        )
        rows.append(validation.row(student, **common, method=f"+ distill, random sequences of {length}",
                                   distill_seconds=result.seconds))
    return rows


PART_ROWS = {"shrinkage": shrinkage_rows, "distill_length": distill_length_rows}
TITLES = {
    "shrinkage": "uniform ranks vs SVD-LLM",
    "distill_length": f"{TARGET_RECIPE}, then distill with random sequences of each length",
}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    validation = Validation()
    for part in args.only:
        frame = pd.DataFrame(PART_ROWS[part](validation))
        frame.insert(0, "machine", device_name("cpu"))
        frame.to_csv(args.output_dir / f"validation_{part}.csv", index=False)
        print(frame.drop(columns="machine").to_string(index=False), flush=True)
        plot(frame, args.output_dir / f"validation_{part}.png", TITLES[part])


if __name__ == "__main__":
    main()
