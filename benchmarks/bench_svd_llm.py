"""Uniform activation-aware fits against SVD-LLM at the same ranks on all-MiniLM-L6-v2.

SVD-LLM (Wang et al. 2024, "SVD-LLM: Truncation-aware Singular Value Decomposition for Large
Language Model Compression") is written here from the paper, outside the library: each layer's
input Gram ``G = XᵀX`` over the calibration tokens (real tokens only: padding is not data), its
Cholesky factor ``S`` (``S Sᵀ = G``, a tiny ridge added when ``G`` is singular), the SVD of
``W·S``, truncated at rank ``r``, and ``S⁻¹`` folded back: ``Ŵ = U_r Σ_r (V_rᵀ S⁻¹)``. Its ranks
are the ones ``panther_lite.convert(allocation="uniform")`` chose (``2·num_terms·low_rank``
per layer), so both store the same rank.

all 36 encoder linear layers (the pooler excluded), calibrated on the first 40 sentences of
``benchmarks/data/natural_sentences.txt`` (padded batches of 32), evaluated by the mean cosine of
the sentence embeddings to the original model's on the next 40 sentences (in domain) and on 200
Python standard-library docstring sentences (out of domain), at R = 0.3 and 0.5 stored.

    python benchmarks/bench_svd_llm.py --label after     # appends rows to svd_llm_minilm.csv
    python benchmarks/bench_svd_llm.py --plot-only       # the PNG from the CSV
"""
from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

import panther_lite
from panther_lite.benchmark import device_name, new_figure, save_figure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import NATURAL_SENTENCES, _docstring_sentences, _load_minilm, _mean_cosine  # noqa: E402

RATIOS = (0.3, 0.5)
CALIBRATION, EVALUATION, DOCSTRINGS = 40, 40, 200
# the library's settings compared (those this version of the library has); the default is shrinkage="auto"
SETTINGS = {"default": {}, "shrinkage=0": dict(shrinkage=0)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/cpu"))
    parser.add_argument("--label", default="after", help="the library version measured (a CSV column)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the tests)")
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def _linear_layers(encoder: nn.Module) -> dict:
    return {name: module for name, module in encoder.named_modules() if isinstance(module, nn.Linear)}


def real_token_grams(model: nn.Module, layers: dict, batches: list) -> dict:
    """``{name: XᵀX}`` (float64) of each layer's inputs at the unmasked positions."""
    grams = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in layers.items()}
    mask = [None]

    def hook(name):
        def pre_hook(module, args):
            rows = args[0][mask[0]].double()
            grams[name].addmm_(rows.t(), rows)

        return pre_hook

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in layers.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[0] = batch["attention_mask"].bool()
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return grams


def svd_llm_weight(weight: torch.Tensor, gram: torch.Tensor, rank: int) -> torch.Tensor:
    """SVD-LLM's rank-``rank`` weight: truncation-aware whitening by the Cholesky factor of ``gram``."""
    w = weight.detach().double()
    ridge = 0.0
    while True:
        factor, info = torch.linalg.cholesky_ex(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype))
        if int(info) == 0:
            break
        ridge = max(2 * ridge, 1e-6 * float(gram.diagonal().mean()))
    left, values, right_t = torch.linalg.svd(w @ factor, full_matrices=False)
    folded = torch.linalg.solve_triangular(factor, right_t[:rank], upper=False, left=False)  # V_rᵀ S⁻¹
    return ((left[:, :rank] * values[:rank]) @ folded).to(weight.dtype)


def _batches(tokenizer, text: list) -> list:
    return [
        dict(tokenizer(text[i : i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        for i in range(0, len(text), 32)
    ]


def _ours(model, batches: list, ratio: float, options: dict):
    converted = copy.deepcopy(model)
    report = panther_lite.convert(
        converted[0].auto_model, target_modules="all-linear", exclude_modules=["pooler.dense"], param_ratio=ratio,
        allocation="uniform", calibration_data=batches, progress=False, **options,
    )
    return converted, report


def _svd_llm(model, batches: list, ranks: dict):
    converted = copy.deepcopy(model)
    encoder = converted[0].auto_model
    layers = {name: module for name, module in _linear_layers(encoder).items() if name in ranks}
    grams = real_token_grams(encoder, layers, batches)
    with torch.no_grad():
        for name, module in layers.items():
            module.weight.copy_(svd_llm_weight(module.weight, grams[name], ranks[name]))
    return converted


def measure(label: str, quick: bool) -> list:
    model = _load_minilm()
    natural = [line.strip() for line in NATURAL_SENTENCES.read_text().splitlines() if line.strip()]
    sizes = (8, 8, 16) if quick else (CALIBRATION, EVALUATION, DOCSTRINGS)
    evaluation = {"in_domain": natural[sizes[0] : sum(sizes[:2])], "out_of_domain": _docstring_sentences(sizes[2])}
    references = {name: model.encode(text, convert_to_tensor=True, batch_size=64) for name, text in evaluation.items()}
    batches = _batches(model.tokenizer, natural[: sizes[0]])
    known = set(inspect.signature(panther_lite.ConvertConfig).parameters)
    rows = []
    for ratio in RATIOS[:1] if quick else RATIOS:
        ranks = None
        for setting, options in SETTINGS.items():
            if not set(options) <= known:
                continue
            start = time.perf_counter()
            converted, report = _ours(model, batches, ratio, options)
            seconds = time.perf_counter() - start
            done = report[report["status"] == "converted"]
            ranks = {name: 2 * int(t) * int(k) for name, t, k in zip(done["name"], done["num_terms"], done["low_rank"])}
            extra = {}
            if "shrinkage" in report:
                extra = dict(mean_shrinkage=float(report["shrinkage"].mean()), rows=int(report["calibration_rows"].max()))
            rows.append(_row(label, ratio, f"panther_lite uniform, {setting}", converted, evaluation, references,
                             seconds, **extra))
        start = time.perf_counter()
        converted = _svd_llm(model, batches, ranks)
        rows.append(_row(label, ratio, "SVD-LLM (same ranks)", converted, evaluation, references,
                         time.perf_counter() - start))
    return rows


def _row(label, ratio, method, converted, evaluation, references, seconds, **extra) -> dict:
    cosines = {name: _mean_cosine(converted, text, references[name]) for name, text in evaluation.items()}
    row = dict(version=label, param_ratio=ratio, method=method, **cosines, seconds=seconds, **extra)
    print(row, flush=True)
    return row


def plot(frame: pd.DataFrame, path: Path, title: str = "uniform ranks vs SVD-LLM") -> None:
    fig = new_figure(figsize=(13, 0.45 * len(frame) + 1.5))
    axes = fig.subplots(1, 2, sharey=True)
    labels = frame["version"] + ": R=" + frame["param_ratio"].map("{:.1f}".format) + ", " + frame["method"]
    for ax, column in zip(axes, ("in_domain", "out_of_domain")):
        ax.barh(range(len(frame)), frame[column], color=["tab:gray" if "SVD-LLM" in m else "tab:blue" for m in frame["method"]])
        for y, value in enumerate(frame[column]):
            ax.text(value, y, f" {value:.3f}", va="center", fontsize=7)
        ax.set_xlim(max(0.0, frame[column].min() - 0.05), min(1.0, frame[column].max() + 0.04))
        ax.set_xlabel(f"mean embedding cosine, {column.replace('_', ' ')}")
    axes[0].set_yticks(range(len(frame)), labels, fontsize=7)
    fig.suptitle(f"all-MiniLM-L6-v2, 36 linear layers, {title} — {frame['machine'].iloc[0]}", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    csv = args.output_dir / "svd_llm_minilm.csv"
    if not args.plot_only:
        frame = pd.DataFrame(measure(args.label, args.quick))
        frame.insert(0, "machine", device_name("cpu"))
        if csv.exists():
            old = pd.read_csv(csv)
            frame = pd.concat([old[old["version"] != args.label], frame], ignore_index=True)
        frame.to_csv(csv, index=False)
    frame = pd.read_csv(csv)
    print(frame.drop(columns="machine").to_string(index=False))
    plot(frame, args.output_dir / "svd_llm_minilm.png")


if __name__ == "__main__":
    main()
