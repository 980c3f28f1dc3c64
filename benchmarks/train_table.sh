# Sourced by the benchmark scripts that train several `unison train` runs and table them (markdown):
#   unison=.venv/bin/unison; out=runs/x; source benchmarks/train_table.sh
#   table_header; train_row "simclr" "$out/simclr" --method simclr
# A run whose summary.json exists is not trained again (its row says wall 0), so an interrupted script goes on.
# Columns: kNN top-1 of the trained encoder, of the randomly initialised one ('-' with --no-random-init-knn), wall.

table_header() {
  echo "| run | kNN top-1 | random init | wall (s) |" > "$out/table.md"
  echo "|---|---|---|---|" >> "$out/table.md"
}

summary_row() {   # name, run dir, wall seconds
  python3 - "$2/summary.json" "$1" "$3" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
init = s.get("random_init_knn_top1")
print(f"| {sys.argv[2]} | {s['knn_top1']:.4f} | {'-' if init is None else f'{init:.4f}'} | {float(sys.argv[3]):.0f} |")
PY
}

train_row() {   # name, run dir, unison train flags...: trains (unless done), appends the run's row, prints it
  local name=$1 dir=$2; shift 2
  if [ -f "$dir/summary.json" ]; then
    summary_row "$name" "$dir" 0 >> "$out/table.md"
  else
    local start; start=$(date +%s)
    $unison train --out "$dir" --no-progress "$@" > "$dir.log" 2>&1
    summary_row "$name" "$dir" $(( $(date +%s) - start )) >> "$out/table.md"
  fi
  tail -1 "$out/table.md"
}
