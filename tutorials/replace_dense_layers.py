"""Tutorial: replace the dense layers of an MLP with SKLinear and train it from scratch.

Workflow 1 of panther_lite. We

1. build the same MLP twice — once with ``nn.Linear`` hidden layers, once with
   ``SKLinear`` (``y = 1/(2L) Σ_i (x S1_i U1_i + x U2_i S2_i) + b``) in their place;
2. train both on scikit-learn's bundled digits data set (8×8 images, 10 classes) with
   :mod:`panther_lite.benchmark`'s digits task (:func:`~panther_lite.benchmark.load_digits_split`,
   :func:`~panther_lite.benchmark.mlp_classifier`, :func:`~panther_lite.benchmark.train_classifier`)
   and compare test accuracy and parameter counts (trainable *and* stored: the fixed U
   sketch buffers are stored but never trained);
3. measure one wide layer's forward and forward+backward time (median of repeated,
   synchronised runs via :func:`panther_lite.benchmark.time_callable`), its stored
   parameters and their bytes (:func:`panther_lite.benchmark.parameter_bytes`) and its
   training-forward memory (:func:`panther_lite.benchmark.training_memory_bytes`: the
   allocator's peak on CUDA, parameters + activations saved for backward on the CPU),
   against ``nn.Linear`` at the same dtype in the same run.

Run ``python tutorials/replace_dense_layers.py --help`` for options; ``--quick`` uses
tiny sizes (seconds on a laptop CPU). Plots are written to ``--output-dir``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn

from panther_lite.benchmark import (
    accuracy,
    count_parameters,
    forward_backward_step,
    forward_step,
    load_digits_split,
    mlp_classifier,
    new_figure,
    parameter_bytes,
    save_figure,
    time_callable,
    train_classifier,
    training_memory_bytes,
)
from panther_lite.nn import SKLinear


def layer_costs(width, batch, num_terms, low_rank, device, dtype, warmup, repeats):
    """Time (ms), stored parameters and memory (MiB) of one ``width × width`` layer on a
    ``batch × width`` input, dense vs sketched: one dict per layer."""
    x = torch.randn(batch, width, device=device, dtype=dtype)
    rows = []
    for name, layer in (
        ("nn.Linear", nn.Linear(width, width, device=device, dtype=dtype)),
        (
            f"SKLinear(L={num_terms}, k={low_rank})",
            SKLinear(width, width, num_terms, low_rank, device=device, dtype=dtype, seed=0),
        ),
    ):
        timing = dict(device=device, warmup=warmup, repeats=repeats)
        rows.append(
            dict(
                layer=name,
                forward_ms=time_callable(forward_step(layer, x), **timing),
                train_step_ms=time_callable(forward_backward_step(layer, x), **timing),
                stored_params=count_parameters(layer).stored,
                parameter_mib=parameter_bytes(layer) / 2**20,
                training_memory_mib=training_memory_bytes(layer, x.detach().requires_grad_(True)) / 2**20,
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds on a CPU")
    parser.add_argument("--output-dir", type=Path, default=Path("tutorial_outputs/replace_dense_layers"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-terms", type=int, default=1, help="L, sketch terms per layer")
    parser.add_argument("--low-rank", type=int, default=16, help="k, rank of each term")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    hidden = 64 if args.quick else 512
    epochs = 2 if args.quick else args.epochs
    widths = [64, hidden, hidden, 10]
    train_set, test_set = load_digits_split(test_fraction=0.2, seed=0, device=device)

    print(f"== 1. Train an MLP {widths} on digits ({epochs} epochs, {device}) ==")
    results = {}
    for name, kwargs in (
        ("dense", {}),
        ("sketched", dict(num_terms=args.num_terms, low_rank=args.low_rank)),
    ):
        model = mlp_classifier(widths, seed=args.seed, **kwargs).to(device)
        losses = train_classifier(model, train_set, epochs=epochs, lr=3e-3, seed=args.seed)
        counts = count_parameters(model)
        results[name] = losses
        print(
            f"{name:>9}: test accuracy {accuracy(model, test_set):.3f}, final loss {losses[-1]:.4f}, "
            f"trainable params {counts.trainable:,}, stored (with U buffers) {counts.stored:,}"
        )

    width = 128 if args.quick else 4096
    batch = 32 if args.quick else 512
    warmup, repeats = (1, 3) if args.quick else (5, 30)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"\n== 2. One {width}x{width} layer, batch {batch}, {dtype}: median of {repeats} runs ==")
    rows = layer_costs(width, batch, args.num_terms, args.low_rank, device, dtype, warmup, repeats)
    for row in rows:
        print(
            f"{row['layer']:>24}: forward {row['forward_ms']:.3f} ms, forward+backward {row['train_step_ms']:.3f} ms, "
            f"stored params {row['stored_params']:,} ({row['parameter_mib']:.3f} MiB), "
            f"training-forward memory {row['training_memory_mib']:.3f} MiB"
        )
    dense, sketched = rows
    print(
        f"speed-up over nn.Linear: forward {dense['forward_ms'] / sketched['forward_ms']:.2f}x, "
        f"forward+backward {dense['train_step_ms'] / sketched['train_step_ms']:.2f}x "
        f"(FLOP ratio {width / (4 * args.num_terms * args.low_rank):.1f}x); "
        f"training-forward memory dense/sketched {dense['training_memory_mib'] / sketched['training_memory_mib']:.2f}x"
    )

    fig = new_figure(figsize=(15, 4))
    ax_loss, ax_time, ax_memory = fig.subplots(1, 3)
    for name, losses in results.items():
        ax_loss.plot(range(1, len(losses) + 1), losses, marker="o", label=name)
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="digits MLP")
    ax_loss.legend()
    labels = [row["layer"] for row in rows]
    positions = torch.arange(len(rows)).float()
    ax_time.bar(positions - 0.2, [row["forward_ms"] for row in rows], 0.4, label="forward")
    ax_time.bar(positions + 0.2, [row["train_step_ms"] for row in rows], 0.4, label="forward+backward")
    ax_time.set_xticks(positions.tolist(), labels)
    ax_time.set(ylabel="median ms", title=f"{width}x{width} layer, batch {batch}")
    ax_time.legend()
    ax_memory.bar(positions - 0.2, [row["parameter_mib"] for row in rows], 0.4, label="parameters + buffers")
    ax_memory.bar(positions + 0.2, [row["training_memory_mib"] for row in rows], 0.4, label="training forward")
    ax_memory.set_xticks(positions.tolist(), labels)
    ax_memory.set(ylabel="MiB", title="memory")
    ax_memory.legend()
    path = save_figure(fig, args.output_dir / "replace_dense_layers.png", dpi=100)
    print(f"\nplot saved to {path}")


if __name__ == "__main__":
    main()
