#!/usr/bin/env bash
# Create .venv (once) and install panther_lite with its test, docs and benchmark extras.
# TORCH_SPEC picks the torch build; the default is the CPU build this project's machines
# keep on local disk. On a GPU machine use e.g. TORCH_SPEC="torch" (CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
.venv/bin/pip install -q -e ".[test,docs,bench]"
