#!/usr/bin/env bash
# SimCLR on the embedded digits (2 gloo workers, small CNN, 30 epochs = 150 steps, optimiser batch 256, seed 0):
# K=1 (batch 256) vs --grad-sync-every 4 (micro-batch 64) exact vs independent; final kNN top-1 and loss curves.
# Usage: benchmarks/accum_digits.sh [OUT_DIR] [extra `unison train` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/accum_digits}; shift || true
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
run() {  # name, flags...
  local name=$1; shift
  local start; start=$(date +%s)
  "$py" -m unison.cli train --method simclr --out "$out/$name" --no-progress "$@" > "$out/$name.log" 2>&1
  echo "$name $(( $(date +%s) - start ))" >> "$out/wall.txt"
}
run k1 --batch-size 256 "$@"
run k4_exact --batch-size 64 --grad-sync-every 4 "$@"
run k4_independent --batch-size 64 --grad-sync-every 4 --accumulation independent "$@"
"$py" - "$out" <<'PY'
import csv, json, sys
from pathlib import Path
out = Path(sys.argv[1])
wall = dict(line.split() for line in (out / "wall.txt").read_text().splitlines())
print("| run | kNN top-1 | random init | final loss | loss at steps 30/60/90/120/150 | wall (s) |")
print("|---|---|---|---|---|---|")
for name in ("k1", "k4_exact", "k4_independent"):
    s = json.loads((out / name / "summary.json").read_text())
    curve = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(out / name / "metrics.csv")) if r["loss"]}
    marks = " / ".join(f"{curve[k]:.3f}" for k in (30, 60, 90, 120, 150) if k in curve)
    print(f"| {name} | {s['knn_top1']:.4f} | {s['random_init_knn_top1']:.4f} | {s['final_loss']:.4f} | {marks} | "
          f"{wall[name]} |")
PY
