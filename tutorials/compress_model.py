"""Tutorial: compress a trained model with panther_lite.convert, tune it, fine-tune, save and reload.

Workflow 2 of panther_lite. We

1. train a dense MLP on scikit-learn's bundled digits data set (8×8 images, 10 classes) with
   :mod:`panther_lite.benchmark.tasks` (one loader, one split, one training loop);
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
4. spend one budget well: ``allocation="global"`` (one budget for all layers, given where the
   whitened spectra say it buys the most), ``sequential=True`` (each layer fitted to the
   original outputs from the inputs the compressed layers before it now give it), and
   :func:`panther_lite.tune` (the smallest budget within one point of dense accuracy);
5. save a converted model (``state_dict`` + :func:`panther_lite.conversion_config` as
   JSON), load it into a fresh dense model with
   :func:`panther_lite.apply_conversion_config`, and turn it back into a dense model with
   :func:`panther_lite.densify`.

Run ``python tutorials/compress_model.py --help`` for options; ``--quick`` uses tiny sizes
(seconds on a laptop CPU). The results tables and a plot of accuracy against stored size are
written to ``--output-dir`` as ``compress_model_digits.csv`` (step 2/3),
``compress_model_workflow.csv`` (step 4) and ``compress_model_digits.png`` (the full run's CPU
results are committed under ``benchmarks/results/cpu``); the saved checkpoint of step 5 goes
to a temporary directory.
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import pandas as pd
import torch

import panther_lite
from panther_lite.benchmark import count_parameters, new_figure, save_figure
from panther_lite.benchmark.tasks import accuracy, load_digits_split, mlp_classifier, train_classifier
from panther_lite import plot_search, tune

RESULTS_STEM = "compress_model_digits"
WORKFLOW_STEM = "compress_model_workflow"
HEAD = "4"  # the classifier head of mlp_classifier([64, h, h, 10])

INITS = {
    "sketch": lambda x: dict(init="sketch", seed=0),
    "svd": lambda x: dict(init="svd"),
    "calibrated": lambda x: dict(init="svd", calibration_data=list(x.split(256))),
}


def stored_params(model):
    """Parameters plus buffers (the fixed U sketches are stored, though never trained)."""
    return count_parameters(model).stored


def fine_tune(model, train_set, epochs, seed):
    train_classifier(model, train_set, epochs=epochs, lr=1e-3, weight_decay=1.0, seed=seed)


def compress_sweep(dense, train_set, test_set, ratios, finetune_epochs, seed):
    """Convert copies of ``dense`` at each ratio with each init, then fine-tune them."""
    rows = []
    for ratio in ratios:
        for init, kwargs in INITS.items():
            model = copy.deepcopy(dense)
            report = panther_lite.convert(
                model, param_ratio=ratio, exclude_modules=[HEAD], progress=False, **kwargs(train_set.x)
            )
            converted = accuracy(model, test_set)
            fine_tune(model, train_set, finetune_epochs, seed)
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


def workflow(dense, train_set, test_set, ratio):
    """One budget spent three ways, then the budget tune finds for "within 1 point"."""
    calibration = list(train_set.x.split(256))
    common = dict(exclude_modules=[HEAD], calibration_data=calibration, progress=False)
    options = {
        "uniform": dict(allocation="uniform"),
        "global": dict(allocation="global"),
        "global + sequential": dict(allocation="global", sequential=True),
    }
    rows = []
    for name, extra in options.items():
        model = copy.deepcopy(dense)
        report = panther_lite.convert(model, param_ratio=ratio, **common, **extra)
        ranks = ", ".join(f"{r.name}: rank {r.low_rank}" for r in report.itertuples() if r.status == "converted")
        print(f"{name:<20} accuracy {accuracy(model, test_set):.3f}  ({ranks})")
        rows.append(dict(method=name, budget=ratio, stored_params=stored_params(model), accuracy=accuracy(model, test_set)))
    model = copy.deepcopy(dense)
    report = tune(model, lambda m: accuracy(m, test_set), tolerance=0.01, **common)
    search = report.attrs["search"]
    print(f"tune: budget {report.attrs['tune_budget']:.3f} after {len(search) - 1} evaluations (dense first):")
    print(search.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    rows.append(
        dict(method="tune (within 1 point)", budget=report.attrs["tune_budget"], stored_params=stored_params(model),
             accuracy=accuracy(model, test_set))
    )
    return pd.DataFrame(rows), report


def save_and_reload(model, hidden, checkpoint_dir, test_set):
    """Save a converted model to ``checkpoint_dir``, rebuild it in a fresh dense MLP, and densify it again."""
    torch.save(model.state_dict(), checkpoint_dir / "compressed.pt")
    (checkpoint_dir / "compressed.json").write_text(json.dumps(panther_lite.conversion_config(model), indent=1))
    fresh = mlp_classifier([64, hidden, hidden, 10]).to(test_set.x.device)
    panther_lite.apply_conversion_config(fresh, json.loads((checkpoint_dir / "compressed.json").read_text()))
    fresh.load_state_dict(torch.load(checkpoint_dir / "compressed.pt", weights_only=True))
    fresh.eval()
    with torch.no_grad():
        same = torch.equal(fresh(test_set.x), model(test_set.x))
    dense_again = panther_lite.densify(copy.deepcopy(fresh))
    print(
        f"reloaded with weights_only=True: outputs identical={same}, accuracy {accuracy(fresh, test_set):.3f}; "
        f"densified: accuracy {accuracy(dense_again, test_set):.3f}, stored params {stored_params(dense_again):,}"
    )


def plot(table, dense_accuracy, dense_size, tuned, path):
    fig = new_figure(figsize=(12, 4.5))
    ax, search_ax = fig.subplots(1, 2)
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
    plot_search(tuned, ax=search_ax)
    search_ax.set_title("panther_lite.tune: accuracy within 1 point of dense")
    save_figure(fig, path, dpi=120)


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
    hidden = 64 if args.quick else args.hidden
    epochs, finetune_epochs = (2, 1) if args.quick else (args.epochs, args.finetune_epochs)
    ratios = (0.5, 0.25) if args.quick else (0.5, 0.25, 0.125, 0.0625)
    train_set, test_set = load_digits_split(test_fraction=0.5, seed=0, device=args.device)

    print(f"== 1. Train a dense MLP 64→{hidden}→{hidden}→10 on digits ({epochs} epochs, {args.device}) ==")
    dense = mlp_classifier([64, hidden, hidden, 10], seed=args.seed).to(args.device)
    train_classifier(dense, train_set, epochs=epochs, lr=2e-3, weight_decay=1.0, seed=args.seed)
    dense_accuracy, dense_size = accuracy(dense, test_set), stored_params(dense)
    print(f"dense: test accuracy {dense_accuracy:.3f}, {dense_size:,} parameters")

    print("\n== 2./3. Convert at several budgets with each init, then fine-tune ==")
    table = compress_sweep(dense, train_set, test_set, ratios, finetune_epochs, args.seed)
    table = table.assign(dense_accuracy=dense_accuracy, dense_stored_params=dense_size)

    print("\n== 4. One budget for all layers, sequential fits, and tune ==")
    workflow_table, tuned = workflow(dense, train_set, test_set, 0.25)

    print("\n== 5. Save, reload into a fresh model, densify ==")
    model = copy.deepcopy(dense)
    panther_lite.convert(
        model, param_ratio=0.25, exclude_modules=[HEAD], calibration_data=list(train_set.x.split(256)), progress=False
    )
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        save_and_reload(model, hidden, Path(checkpoint_dir), test_set)

    print(f"\n== Results (dense accuracy {dense_accuracy:.3f}, {dense_size:,} stored params) ==")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(workflow_table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    csv_path, png_path = args.output_dir / f"{RESULTS_STEM}.csv", args.output_dir / f"{RESULTS_STEM}.png"
    table.to_csv(csv_path, index=False)
    workflow_table.to_csv(args.output_dir / f"{WORKFLOW_STEM}.csv", index=False)
    plot(table, dense_accuracy, dense_size, tuned, png_path)
    print(f"\nwrote {csv_path}, {args.output_dir / (WORKFLOW_STEM + '.csv')} and {png_path}")
    return table


if __name__ == "__main__":
    main()
