#!/usr/bin/env bash
# Every method on the main job's embedded default (digits, 2 gloo workers, small CNN, 30 epochs):
# kNN top-1 of the trained encoder vs the randomly initialised one, and wall time per method.
# Usage: benchmarks/methods_digits.sh [OUT_DIR] [extra `unison train` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/methods_digits}; shift || true
mkdir -p "$out"
echo "| method | kNN top-1 | random init | wall (s) |" > "$out/table.md"
echo "|---|---|---|---|" >> "$out/table.md"
for m in simclr moco byol simsiam barlowtwins swav vicreg dino; do
  start=$(date +%s)
  .venv/bin/unison train --method "$m" --out "$out/$m" --no-progress "$@" > "$out/$m.log" 2>&1
  wall=$(( $(date +%s) - start ))
  .venv/bin/python - "$out/$m/summary.json" "$m" "$wall" >> "$out/table.md" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {s['knn_top1']:.4f} | {s['random_init_knn_top1']:.4f} | {float(sys.argv[3]):.0f} |")
PY
  tail -1 "$out/table.md"
done
