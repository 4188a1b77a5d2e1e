"""A frozen sketched model in onnxruntime's CUDA provider against PyTorch on the same GPU.

A random 3-layer MLP (``--width``, default 4096) is converted at ``param_ratio=0.25``, frozen
(:func:`panther_lite.freeze`), exported to ONNX and run by onnxruntime's
``CUDAExecutionProvider``; its output is compared with the frozen model's in PyTorch (float32,
TF32 off), and both are timed (medians of interleaved rounds; onnxruntime's time includes the
host-to-device copy of the input and the copy back, as a user of ``session.run`` pays it).
Writes ``onnx_cuda.csv`` to ``--output-dir``. Exits with status 2 when this onnxruntime build
has no CUDA provider (the CPU-only ``onnxruntime`` wheel; ``onnxruntime-gpu`` has it).

    python benchmarks/bench_onnx_cuda.py --output-dir benchmarks/results/cuda
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

import panther_lite
from panther_lite.benchmark import Spread, device_name, time_interleaved
from panther_lite.cli.arguments import positive_int
from panther_lite.benchmark.deploy import export_onnx, onnx_runner

PROVIDER = "CUDAExecutionProvider"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=positive_int, default=4096, help="features of every layer")
    parser.add_argument("--batch", type=positive_int, default=1024, help="rows of the input")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed rounds")
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out/cuda"))
    return parser.parse_args(argv)


def frozen_mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
    )
    panther_lite.convert(model, param_ratio=0.25, progress=False)
    return panther_lite.freeze(model).eval()


def main(argv=None) -> int:
    args = parse_args(argv)
    import onnxruntime

    if PROVIDER not in onnxruntime.get_available_providers():
        print(f"onnxruntime {onnxruntime.__version__} has no {PROVIDER}: {onnxruntime.get_available_providers()}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    model = frozen_mlp(args.width).cuda()
    x = torch.randn(args.batch, args.width, device="cuda")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        path = export_onnx(model.cpu(), (x.cpu(),), Path(tmp) / "frozen.onnx", ["x"], {"x": {0: "batch"}})
        model.cuda()
        run = onnx_runner(path, provider=PROVIDER)
        want, got = model(x), run(x).cuda()
        error = float((got - want).norm() / want.norm())
        samples = time_interleaved({"torch": lambda: model(x), "onnxruntime": lambda: run(x)}, device="cuda",
                                   warmup=3, repeats=args.repeats)  # fmt: skip
    rows = [dict(device_name=device_name("cuda"), onnxruntime=onnxruntime.__version__, runtime=name, width=args.width,
                 batch=args.batch, latency_ms=Spread.of(s).median, latency_iqr_ms=Spread.of(s).iqr,
                 relative_error=error if name == "onnxruntime" else 0.0) for name, s in samples.items()]  # fmt: skip
    args.output_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.output_dir / "onnx_cuda.csv", index=False)
    print(pd.DataFrame(rows).to_string(index=False))
    return 0 if error < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
