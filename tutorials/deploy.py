"""Tutorial: deploy a compressed model — ONNX export, freeze, and int8 through the quantizers.

Workflow 4 of panther_lite. We

1. train the digits MLP and compress its hidden layers with :func:`panther_lite.convert`
   (25% of their stored size, calibrated);
2. export the converted model to ONNX with both exporters (``torch.onnx.export`` with
   ``dynamo=False`` and ``dynamo=True``), a dynamic batch axis, and run it in onnxruntime: the
   graph holds two ``MatMul`` per sketched layer and weights the size of the factors;
3. :func:`panther_lite.freeze` it — each sketched layer becomes ``nn.Linear(in, 2Lk)`` then
   ``nn.Linear(2Lk, out)`` — and quantize it to int8 with ``quantize_dynamic``, which
   now finds two ``nn.Linear`` per sketched layer (on the unfrozen model it quantizes
   nothing sketched, and :func:`panther_lite.freeze` and :func:`panther_lite.save_pretrained`
   warn about that);
4. compare size on disk, CPU latency and accuracy of dense, converted, frozen and frozen
   + int8, in PyTorch and onnxruntime (:mod:`panther_lite.benchmark.deploy`), and plot them.

Run ``python tutorials/deploy.py --help`` for options; ``--quick`` uses tiny sizes
(seconds on a laptop CPU). Plots are written to ``--output-dir``.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

import panther_lite
from panther_lite.benchmark import accuracy, load_digits_split, mlp_classifier, train_classifier
from panther_lite.benchmark.deploy import deploy_rows, deployable_forms, export_onnx, onnx_runner, plot_deploy
from panther_lite.conversion import FrozenLinear

# the two hidden layers at 25% of their stored size (one global budget)
CONVERT_OPTIONS = dict(target_modules=["0", "2"], param_ratio=0.25, allocation="global", progress=False)


def section_export(converted: nn.Module, test, workdir: Path) -> None:
    import onnx

    print("== 2. ONNX export of the converted model ==")
    for dynamo in (False, True):
        path = export_onnx(converted, (test.x[:4],), workdir / f"converted_{dynamo}.onnx", ["x"], {"x": {0: "batch"}},
                           dynamo=dynamo)
        graph = onnx.load(str(path))
        matmuls = sum(node.op_type == "MatMul" for node in graph.graph.node)
        outputs = onnx_runner(path)(test.x)  # 450 rows: another batch size than the example's 4
        with torch.no_grad():
            error = ((outputs - converted(test.x)).abs().max() / converted(test.x).abs().max()).item()
        exporter = "dynamo" if dynamo else "TorchScript"
        print(f"{exporter} exporter: {matmuls} MatMul nodes, relative error in onnxruntime {error:.1e}")


def section_freeze_and_quantize(converted: nn.Module, test) -> None:
    print("== 3. freeze, then int8 ==")
    quantized_first = torch.ao.quantization.quantize_dynamic(copy.deepcopy(converted), {nn.Linear})
    still_float = sum(isinstance(m, panther_lite.SKLinear) for m in quantized_first.modules())
    print(f"quantize_dynamic before freeze: {still_float} sketched layers skipped, still float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        panther_lite.freeze(quantized_first)
    print(f"freeze noticed it: {sum('the quantizer skipped' in str(w.message) for w in caught)} warning(s)")
    frozen = panther_lite.freeze(copy.deepcopy(converted))
    pairs = sum(isinstance(m, FrozenLinear) for m in frozen.modules())
    quantized = torch.ao.quantization.quantize_dynamic(frozen, {nn.Linear})
    int8 = sum(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in quantized.modules())
    print(f"freeze, then quantize_dynamic: {pairs} frozen pairs, {int8} int8 Linear layers; "
          f"test accuracy {accuracy(quantized, test):.3f} (converted {accuracy(converted, test):.3f})")


def section_compare(dense: nn.Module, train, test, repeats: int, output_dir: Path) -> None:
    print("== 4. size, latency and accuracy of each form ==")
    forms = deployable_forms(dense, calibration_data=list(train.x.split(128)), **CONVERT_OPTIONS)

    def test_accuracy(run) -> float:
        return float((run(test.x).argmax(1) == test.y).float().mean())

    rows = deploy_rows(forms, (test.x,), ["x"], {"x": {0: "batch"}}, test_accuracy, repeats=repeats)
    for row in rows:
        print(f"{row['form']:>14} / {row['runtime']:<11}: {1e3 * row['size_mb']:7.1f} kB, "
              f"{row['latency_ms']:6.3f} ms for 450 rows, test accuracy {row['quality']:.3f}")
    path = plot_deploy(pd.DataFrame(rows), output_dir / "deploy.png", quality_label="test accuracy",
                       title="digits MLP: dense, converted (25%), frozen, int8")
    print(f"plot: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds on a CPU")
    parser.add_argument("--output-dir", type=Path, default=Path("tutorial_outputs/deploy"))
    parser.add_argument("--device", default="cpu", help="deployment here is on the CPU (only 'cpu')")
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("this tutorial deploys to the CPU: --device must be 'cpu'")
    print("== 1. train and convert the digits MLP ==")
    train, test = load_digits_split()
    dense = mlp_classifier([64, 256, 256, 10], seed=0)
    train_classifier(dense, train, epochs=3 if args.quick else args.epochs, seed=0)
    converted = copy.deepcopy(dense)
    panther_lite.convert(converted, calibration_data=list(train.x.split(128)), **CONVERT_OPTIONS)
    print(f"dense test accuracy {accuracy(dense, test):.3f}, converted {accuracy(converted, test):.3f}")
    with tempfile.TemporaryDirectory() as workdir:
        section_export(converted, test, Path(workdir))
    section_freeze_and_quantize(converted, test)
    section_compare(dense, train, test, 3 if args.quick else 20, args.output_dir)


if __name__ == "__main__":
    main()
