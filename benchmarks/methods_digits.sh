#!/usr/bin/env bash
# Every method on the main job's embedded default (digits, 2 gloo workers, small CNN, 30 epochs):
# kNN top-1 of the trained encoder vs the randomly initialised one, and wall time per method.
# Usage: benchmarks/methods_digits.sh [OUT_DIR] [extra `unison train` flags]
# UNISON=... names the command (default .venv/bin/unison); a run whose summary.json exists is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/methods_digits}; shift || true
mkdir -p "$out"
unison=${UNISON:-.venv/bin/unison}
source benchmarks/train_table.sh
table_header
for m in simclr moco byol simsiam barlowtwins swav vicreg vicregl densecl dino nnclr dcl dclw tico fastsiam mmcr wmse smog \
    empssl; do
  train_row "$m" "$out/$m" --method "$m" "$@"
done
