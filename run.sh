#!/usr/bin/env bash
# One command: set up (first time) and run the main job, `unison train` on its embedded default
# (SimCLR, 2 worker processes on gloo, digits data, kNN against random init). Extra arguments go to
# `unison train`, e.g. ./run.sh --method byol --out runs/byol
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh main   # what training needs; scripts/test.sh adds the test toolchain
exec .venv/bin/unison train "$@"
