#!/usr/bin/env bash
# Does a better teacher, or distillation through a DINO teacher's head, make the distilled student beat the same
# student trained from scratch? Digits, 2 gloo workers, small CNN students of one seed, 30 epochs = 150 steps,
# global batch 256, kNN top-1 (k=200, the 359 held-out images); every setting a default (none chosen on the
# held-out images). Teachers: MoCo and DINO runs of the same small CNN, for 150 steps (= the student trained from
# scratch by that method for the same steps) and for 600 steps (--epochs 120).
# Usage: benchmarks/distill_digits_teachers.sh [OUT_DIR] [extra `unison train` flags for every run]
# UNISON=... names the command (default .venv/bin/unison); a run whose summary.json exists is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
unison=${UNISON:-.venv/bin/unison}
out=${1:-runs/distill_digits_teachers}; shift || true
set -- --no-random-init-knn "$@"   # every run: the table compares trained encoders
mkdir -p "$out"
source benchmarks/train_table.sh
table_header
train_row "scratch: simclr, 150 steps" "$out/scratch_simclr" --method simclr "$@"
train_row "scratch: moco, 150 steps (teacher moco150)" "$out/moco150" --method moco "$@"
train_row "scratch: dino, 150 steps (teacher dino150)" "$out/dino150" --method dino "$@"
train_row "distill from moco150" "$out/kl_moco150" --method distill --teacher "$out/moco150" "$@"
train_row "distill from dino150" "$out/kl_dino150" --method distill --teacher "$out/dino150" "$@"
train_row "distill loss=dino from dino150" "$out/dino_dino150" --method distill --param loss=dino --teacher "$out/dino150" "$@"
train_row "teacher moco600: moco, 600 steps" "$out/moco600" --method moco --epochs 120 "$@"
train_row "distill from moco600" "$out/kl_moco600" --method distill --teacher "$out/moco600" "$@"
train_row "teacher dino600: dino, 600 steps" "$out/dino600" --method dino --epochs 120 "$@"
train_row "distill loss=dino from dino600" "$out/dino_dino600" --method distill --param loss=dino --teacher "$out/dino600" "$@"
train_row "distill from dino600" "$out/kl_dino600" --method distill --teacher "$out/dino600" "$@"
