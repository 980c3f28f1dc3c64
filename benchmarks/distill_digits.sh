#!/usr/bin/env bash
# Distillation on the embedded default (digits, 2 gloo workers, small CNN, 30 epochs = 150 steps, global batch 256):
# a MoCo teacher trained by unison, then the same small-CNN student (a) distilled from it (--method distill) and
# (b) trained from scratch with SimCLR for the same steps; kNN top-1 (k=200, the 359 held-out images) and wall time.
# Usage: benchmarks/distill_digits.sh [OUT_DIR] [extra `unison train` flags for both students]
# UNISON=... names the command (default .venv/bin/unison); an existing OUT_DIR/teacher run is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
unison=${UNISON:-.venv/bin/unison}
out=${1:-runs/distill_digits}; shift || true
mkdir -p "$out"
row() {   # name, run dir, wall seconds
  python3 - "$2/summary.json" "$1" "$3" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {s['knn_top1']:.4f} | {s.get('random_init_knn_top1') or float('nan'):.4f} | {float(sys.argv[3]):.0f} |")
PY
}
timed() {   # name, run dir, unison train flags...
  local name=$1 dir=$2; shift 2
  local start; start=$(date +%s)
  $unison train --out "$dir" --no-progress "$@" > "$dir.log" 2>&1
  row "$name" "$dir" $(( $(date +%s) - start )) >> "$out/table.md"
  tail -1 "$out/table.md"
}
echo "| run | kNN top-1 | random init | wall (s) |" > "$out/table.md"
echo "|---|---|---|---|" >> "$out/table.md"
if [ -f "$out/teacher/summary.json" ]; then
  row "teacher: moco" "$out/teacher" 0 >> "$out/table.md"; tail -1 "$out/table.md"
else
  timed "teacher: moco" "$out/teacher" --method moco
fi
timed "student: distill (queue 512: LightlyTrain's rule for 1,280 images)" "$out/distill" --method distill \
  --teacher "$out/teacher" "$@"
timed "student: distill, --param queue_size=256" "$out/distill_q256" --method distill --teacher "$out/teacher" \
  --param queue_size=256 "$@"
timed "student: simclr from scratch" "$out/scratch" --method simclr "$@"
