#!/usr/bin/env bash
# Distillation on the embedded default (digits, 2 gloo workers, small CNN, 30 epochs = 150 steps, global batch 256):
# a MoCo teacher trained by unison, then the same small-CNN student (a) distilled from it (--method distill) and
# (b) trained from scratch with SimCLR for the same steps; kNN top-1 (k=200, the 359 held-out images) and wall time.
# Usage: benchmarks/distill_digits.sh [OUT_DIR] [extra `unison train` flags for both students]
# UNISON=... names the command (default .venv/bin/unison); a run whose summary.json exists is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
unison=${UNISON:-.venv/bin/unison}
out=${1:-runs/distill_digits}; shift || true
mkdir -p "$out"
source benchmarks/train_table.sh
table_header
train_row "teacher: moco" "$out/teacher" --method moco
train_row "student: distill (queue 512: LightlyTrain's rule for 1,280 images)" "$out/distill" --method distill \
  --teacher "$out/teacher" "$@"
train_row "student: distill, --param queue_size=256" "$out/distill_q256" --method distill --teacher "$out/teacher" \
  --param queue_size=256 "$@"
train_row "student: simclr from scratch" "$out/scratch" --method simclr "$@"
