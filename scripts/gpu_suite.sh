#!/usr/bin/env bash
# On a machine with a CUDA GPU: run the GPU tests and the GPU benchmarks, writing results
# to benchmarks/results/cuda/. Needs a CUDA build of torch importable by $PYTHON (default:
# .venv/bin/python if there is one — set up with TORCH_SPEC=torch bash scripts/setup.sh —
# else python3); the package runs from this checkout (PYTHONPATH), no install needed.
# Pass a stage to run only part: tests | bars | fused | sweep4096 | sweep8192 | conv | onnx | compress | streamed | all (default).
# PYTEST_ARGS adds options to the test stage, e.g. PYTEST_ARGS="-n 8" where pytest-xdist is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=benchmarks/results/cuda
stage="${1:-all}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
run() { [ "$stage" = all ] || [ "$stage" = "$1" ]; }
if run tests; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -rs -m cuda ${PYTEST_ARGS:-}  # the CUDA-marked tests (they skip elsewhere)
fi
if run bars; then
  "$PYTHON" benchmarks/bench_sklinear.py --device cuda --output-dir "$RESULTS"
fi
if run fused; then  # the fused small-rank kernel against the two GEMMs (issue 42; needs Triton, which CUDA torch brings)
  "$PYTHON" benchmarks/bench_fused_product.py --output-dir "$RESULTS"
fi
for n in 4096 8192; do
  if run "sweep$n"; then
    "$PYTHON" benchmarks/sweep.py --device cuda --dtype bfloat16 --in-features "$n" --out-features "$n" \
      --batch-size 4096 --num-terms 1 2 4 8 16 --low-rank 16 32 64 128 256 --no-progress \
      --output-dir "$RESULTS/sweep_$n"
  fi
done
if run conv; then
  "$PYTHON" benchmarks/bench_skconv2d.py --device cuda --dtype bfloat16 --channels 256 --batch 16 --output-dir "$RESULTS"
fi
if run onnx; then  # exit status 2: this onnxruntime build has no CUDA provider
  "$PYTHON" benchmarks/bench_onnx_cuda.py --output-dir "$RESULTS"
fi
if run compress; then  # the TinyLlama shape block by block, statistics and the block at work on the GPU
  "$PYTHON" benchmarks/bench_convert_scale.py --part tinyllama --calibration-device cuda --output-dir "$RESULTS" \
    --note "model on the CPU, calibration on the GPU"
fi
if run streamed; then  # the compress command out of core (each block visits the GPU), 6/12/22 TinyLlama-shaped layers
  "$PYTHON" benchmarks/bench_convert_scale.py --part streamed --calibration-device cuda --output-dir "$RESULTS" \
    --work-dir "${WORK_DIR:-/tmp/panther_lite_streamed}" --note "checkpoints on local disk, calibration on the GPU"
fi
