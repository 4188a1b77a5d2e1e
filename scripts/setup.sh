#!/usr/bin/env bash
# Create .venv (once) and install panther_lite with its test, docs and benchmark extras.
# Without torch in .venv it installs torch==2.13.0 (a CPU build from this project's
# machines' local disk); TORCH_SPEC, when set, is installed instead, e.g. TORCH_SPEC=torch
# for CUDA wheels on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ -n "${TORCH_SPEC:-}" ]; then
  .venv/bin/pip install -q "$TORCH_SPEC"
elif ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[test,docs,bench]"
