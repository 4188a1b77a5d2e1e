"""Tutorial: compress a trained model with panther_lite.convert, fine-tune, save and reload.

Workflow 2 of panther_lite. We

1. train a dense MLP on scikit-learn's bundled digits data set (8×8 images, 10 classes);
2. convert copies of it *in place* with :func:`panther_lite.convert` at several budgets
   (``param_ratio``: stored size of each converted layer, U sketch buffers included, as a
   fraction of the dense layer) with each init:

   - ``"sketch"`` — the anchor's random-sketch estimate of the trained weight;
   - ``"svd"`` — the best rank-``2Lk`` fit of each weight (the default);
   - ``"calibrated"`` — ``init="svd"`` with ``calibration_data``: each layer is fitted to
     the activations it actually sees, optimal for its outputs at that rank;

   the classifier head stays dense (``exclude_modules``): at these budgets it could keep
   only a rank or two of its 10 outputs;
3. fine-tune each converted model briefly and compare test accuracy against stored size;
4. save a converted model (``state_dict`` + :func:`panther_lite.conversion_config` as
   JSON), load it into a fresh dense model with
   :func:`panther_lite.apply_conversion_config`, and turn it back into a dense model with
   :func:`panther_lite.densify`.

Run ``python tutorials/compress_model.py --help`` for options; ``--quick`` uses tiny sizes
(seconds on a laptop CPU). The results table and a plot of accuracy against stored size are
written to ``--output-dir`` as ``compress_model_digits.csv`` and ``compress_model_digits.png``
(the full run's CPU results are committed under ``benchmarks/results/cpu``); the saved
checkpoint of step 4 goes to a temporary directory.
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import panther_lite  # noqa: E402

RESULTS_STEM = "compress_model_digits"

INITS = {
    "sketch": lambda x: dict(init="sketch", seed=0),
    "svd": lambda x: dict(init="svd"),
    "calibrated": lambda x: dict(init="svd", calibration_data=x.split(256)),
}


def digits(device):
    """Pixels scaled to [0, 1], split 50/50 with a fixed permutation."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = len(x) // 2
    train, test = perm[:cut], perm[cut:]
    return (x[train].to(device), y[train].to(device)), (x[test].to(device), y[test].to(device))


def make_mlp(hidden):
    """``64 → hidden → hidden → 10`` with ReLU; the head is module ``"4"``."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def fit(model, data, epochs, lr, seed):
    """AdamW (weight decay 1.0) on mini-batches of 64; returns the model in eval mode."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=1.0)
    x, y = data
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), device=x.device).split(64):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model, data):
    x, y = data
    return (model(x).argmax(1) == y).float().mean().item()


def stored_params(model):
    """Parameters plus buffers (the fixed U sketches are stored, though never trained)."""
    return sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))


def compress_sweep(dense, train_set, test_set, ratios, finetune_epochs, seed):
    """Convert copies of ``dense`` at each ratio with each init, then fine-tune them."""
    rows = []
    for ratio in ratios:
        for init, kwargs in INITS.items():
            model = copy.deepcopy(dense)
            report = panther_lite.convert(
                model, param_ratio=ratio, exclude_modules=["4"], progress=False, **kwargs(train_set[0])
            )
            converted = accuracy(model, test_set)
            fit(model, train_set, finetune_epochs, 1e-3, seed)
            rows.append(
                dict(
                    param_ratio=ratio,
                    init=init,
                    stored_params=stored_params(model),
                    accuracy=converted,
                    finetuned_accuracy=accuracy(model, test_set),
                    mean_weight_error=report["weight_error"].mean(),
                    mean_output_error=report["output_error"].mean(),
                )
            )
            print(f"param_ratio={ratio:<6} init={init:<10} {report.attrs['summary']}")
    return pd.DataFrame(rows)


def save_and_reload(model, hidden, checkpoint_dir, test_set):
    """Save a converted model to ``checkpoint_dir``, rebuild it in a fresh dense MLP, and densify it again."""
    torch.save(model.state_dict(), checkpoint_dir / "compressed.pt")
    (checkpoint_dir / "compressed.json").write_text(json.dumps(panther_lite.conversion_config(model), indent=1))
    fresh = make_mlp(hidden).to(test_set[0].device)
    panther_lite.apply_conversion_config(fresh, json.loads((checkpoint_dir / "compressed.json").read_text()))
    fresh.load_state_dict(torch.load(checkpoint_dir / "compressed.pt", weights_only=True))
    fresh.eval()
    with torch.no_grad():
        same = torch.equal(fresh(test_set[0]), model(test_set[0]))
    dense_again = panther_lite.densify(copy.deepcopy(fresh))
    print(
        f"reloaded with weights_only=True: outputs identical={same}, accuracy {accuracy(fresh, test_set):.3f}; "
        f"densified: accuracy {accuracy(dense_again, test_set):.3f}, stored params {stored_params(dense_again):,}"
    )


def plot(table, dense_accuracy, dense_size, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (init, group), color in zip(table.groupby("init", sort=False), ("tab:red", "tab:blue", "tab:green")):
        group = group.sort_values("stored_params")
        ax.plot(group["stored_params"], group["accuracy"], "o-", color=color, label=f"{init}: converted")
        ax.plot(group["stored_params"], group["finetuned_accuracy"], "s--", color=color, label=f"{init}: + fine-tuned")
    ax.axhline(dense_accuracy, color="black", lw=1, label=f"dense ({dense_size:,} params)")
    ax.set(
        xscale="log",
        xlabel="stored parameters of the whole model (U buffers included)",
        ylabel="test accuracy",
        title="digits MLP compressed with panther_lite.convert",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds on a CPU")
    parser.add_argument("--output-dir", type=Path, default=Path("tutorial_outputs/compress_model"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--epochs", type=int, default=30, help="training epochs of the dense model")
    parser.add_argument("--finetune-epochs", type=int, default=3, help="fine-tuning epochs after conversion")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    hidden = 64 if args.quick else args.hidden
    epochs, finetune_epochs = (2, 1) if args.quick else (args.epochs, args.finetune_epochs)
    ratios = (0.5, 0.25) if args.quick else (0.5, 0.25, 0.125, 0.0625)
    train_set, test_set = digits(device)

    print(f"== 1. Train a dense MLP 64→{hidden}→{hidden}→10 on digits ({epochs} epochs, {device}) ==")
    torch.manual_seed(args.seed)
    dense = fit(make_mlp(hidden).to(device), train_set, epochs, 2e-3, args.seed)
    dense_accuracy, dense_size = accuracy(dense, test_set), stored_params(dense)
    print(f"dense: test accuracy {dense_accuracy:.3f}, {dense_size:,} parameters")

    print("\n== 2./3. Convert at several budgets with each init, then fine-tune ==")
    table = compress_sweep(dense, train_set, test_set, ratios, finetune_epochs, args.seed)
    table = table.assign(dense_accuracy=dense_accuracy, dense_stored_params=dense_size)

    print("\n== 4. Save, reload into a fresh model, densify ==")
    model = copy.deepcopy(dense)
    panther_lite.convert(model, param_ratio=0.25, exclude_modules=["4"], calibration_data=train_set[0].split(256), progress=False)
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        save_and_reload(model, hidden, Path(checkpoint_dir), test_set)

    print(f"\n== Results (dense accuracy {dense_accuracy:.3f}, {dense_size:,} stored params) ==")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    csv_path, png_path = args.output_dir / f"{RESULTS_STEM}.csv", args.output_dir / f"{RESULTS_STEM}.png"
    table.to_csv(csv_path, index=False)
    plot(table, dense_accuracy, dense_size, png_path)
    print(f"\nwrote {csv_path} and {png_path}")
    return table


if __name__ == "__main__":
    main()
