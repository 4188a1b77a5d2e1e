#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a num_terms x low_rank sweep of SKLinear
# against nn.Linear (time, memory, accuracy) that writes a CSV and plots to the git-ignored
# benchmarks/out/<device>/, leaving the checkout clean. Committing results is deliberate:
#   bash scripts/sweep.sh --output-dir benchmarks/results/cpu
# Extra arguments go to benchmarks/sweep.py (see --help), e.g. --device cuda --dtype bfloat16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/sweep.py "$@"
