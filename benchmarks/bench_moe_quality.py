"""Quality of a converted mixture-of-experts model (issue 29): a small MoE classifier trained here
on the digits, dense against compressed at several budgets.

The model reads each 8×8 digit as 8 tokens (its rows of 8 pixels): a linear embedding to
``--hidden`` plus a learned position per row, ``--layers`` residual blocks of transformers' ``MixtralSparseMoeBlock`` (``--experts``
fused experts, top-2, intermediate ``--inter``, the ``eager`` experts implementation), mean
pooling and a linear head; trained with AdamW for ``--epochs`` (:mod:`panther_lite.benchmark.tasks`).
Its experts (``target_modules=["experts"]``: more than 99% of its weights; the routers, the
embedding and the head stay dense) are then converted at each budget in ``--budgets`` (their
stored size over dense, U sketches included) three ways:

- ``weights only``: each projection sized by ``param_ratio``, each expert fitted to its weights;
- ``calibrated``: the same sizes, each expert fitted to the tokens its router sends it (the
  training images as calibration data);
- ``calibrated, global``: one budget spread over the four projections by their whitened
  spectra and gains (``allocation="global"``).

Each row has the test accuracy (25% of the digits held out), the experts' stored ratio, the
expert projections fitted data-free (fewer routed rows than inputs) and the conversion's
seconds. ``--threads`` CPU threads (default 1: tiny products run fastest on one).
Writes ``DIR/moe_quality_digits.csv`` and ``.png`` (DIR defaults to ``benchmarks/out/cpu``).

    python benchmarks/bench_moe_quality.py
    python benchmarks/bench_moe_quality.py --budgets 0.5 0.25 --epochs 10
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

import panther_lite
from panther_lite.benchmark import new_figure, save_figure, write_table_and_figure
from panther_lite.cli.arguments import positive_int
from panther_lite.benchmark.tasks import accuracy, load_digits_split, train_classifier

OUT = Path(__file__).resolve().parent / "out" / "cpu"
METHODS = {
    "weights only": dict(allocation="uniform", calibrated=False),
    "calibrated": dict(allocation="uniform", calibrated=True),
    "calibrated, global": dict(allocation="global", calibrated=True),
}
TOKENS, PIXELS = 8, 8


def _budget(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a budget in (0, 1], got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--inter", type=positive_int, default=128)
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--epochs", type=positive_int, default=40)
    parser.add_argument("--budgets", type=_budget, nargs="+", default=[0.5, 0.35, 0.25, 0.15, 0.1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--output-dir", type=Path, default=OUT)
    return parser.parse_args(argv)


class MoeClassifier(nn.Module):
    """The digits as 8 row-tokens → embedding (+ a learned position) → residual Mixtral sparse-MoE
    blocks → mean → head."""

    def __init__(self, hidden: int, inter: int, experts: int, layers: int) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2)
        config._experts_implementation = "eager"
        self.embed = nn.Linear(PIXELS, hidden)
        self.position = nn.Parameter(0.1 * torch.randn(TOKENS, hidden))  # which row a token is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.blocks = nn.ModuleList([MixtralSparseMoeBlock(config) for _ in range(layers)])
        for block in self.blocks:  # transformers leaves these to its model's init
            nn.init.normal_(block.gate.weight, std=hidden**-0.5)
            nn.init.normal_(block.experts.gate_up_proj, std=hidden**-0.5)
            nn.init.normal_(block.experts.down_proj, std=inter**-0.5)
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(layers)])
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(-1, TOKENS, PIXELS)) + self.position
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h))
        return self.head(h.mean(dim=1))


def _data_free(report: pd.DataFrame) -> int:
    """Expert projections fitted to their weights alone (too few routed rows)."""
    lists = report["data_free_experts"] if "data_free_experts" in report else []
    return int(sum(len(found) for found in lists if isinstance(found, list)))


def run(args: argparse.Namespace) -> pd.DataFrame:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, test = load_digits_split(seed=args.seed)
    dense = MoeClassifier(args.hidden, args.inter, args.experts, args.layers)
    start = time.perf_counter()
    train_classifier(dense, train, epochs=args.epochs, seed=args.seed)
    rows = [dict(method="dense", budget=1.0, accuracy=accuracy(dense, test), stored_ratio=1.0, data_free_experts=0,
                 seconds=time.perf_counter() - start)]  # fmt: skip
    print(f"dense: accuracy {rows[0]['accuracy']:.4f} after {args.epochs} epochs ({rows[0]['seconds']:.0f} s)")
    calibration = list(train.x.split(256))
    for budget in args.budgets:
        for method, options in METHODS.items():
            model = copy.deepcopy(dense)
            data = calibration if options["calibrated"] else None
            start = time.perf_counter()
            report = panther_lite.convert(
                model, param_ratio=budget, allocation=options["allocation"], calibration_data=data,
                target_modules=["experts"], progress=False,
            )
            rows.append(dict(
                method=method, budget=budget, accuracy=accuracy(model, test),
                stored_ratio=float(report["stored_params"].sum() / report["dense_params"].sum()),
                data_free_experts=_data_free(report), seconds=time.perf_counter() - start,
            ))
            print(f"{method:20} budget {budget:.2f}: accuracy {rows[-1]['accuracy']:.4f} "
                  f"(experts stored {rows[-1]['stored_ratio']:.3f})")
    frame = pd.DataFrame(rows)
    for name, value in (("hidden", args.hidden), ("inter", args.inter), ("experts", args.experts),
                        ("layers", args.layers), ("epochs", args.epochs)):  # fmt: skip
        frame[name] = value
    return frame


def plot(frame: pd.DataFrame, path: Path) -> None:
    """Test accuracy against the stored size of the converted layers, one line per method,
    the dense model's accuracy as a horizontal line."""
    fig = new_figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    dense = frame[frame["method"] == "dense"].iloc[0]
    ax.axhline(dense["accuracy"], color="gray", linestyle="--", label=f"dense ({dense['accuracy']:.3f})")
    for index, method in enumerate(METHODS):
        rows = frame[frame["method"] == method].sort_values("stored_ratio")
        ax.plot(rows["stored_ratio"], rows["accuracy"], "o-", color=f"C{index}", label=method)
    ax.set_xlabel("stored size of the experts / dense (U sketches included)")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=8)
    ax.set_title(
        f"digits MoE ({dense['layers']} blocks of {dense['experts']} experts, hidden {dense['hidden']}, "
        f"inter {dense['inter']}): dense vs converted",
        fontsize=9,
    )
    save_figure(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    write_table_and_figure(run(args), args.output_dir / "moe_quality_digits", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
