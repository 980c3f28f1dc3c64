#!/usr/bin/env bash
# A --time-budget run whose machine turns busy part-way: BUSY_AT seconds after the start, BUSY_PROCS processes
# that spin on the CPU start and run until the training ends. What it shows: whether the run re-plans (train.log's
# "re-planned" lines), how many of its planned steps it trained, its last learning rate against the peak (an
# annealed run ends near 0; one ended by the clock stops part-way down its cosine), and its final kNN.
# docs/guides/time-budget.md, "Planned again late".
#
#   bash benchmarks/busy_midway.sh OUT -- unison train --preset speedrun --data D --val V --time-budget 3m
#   BUSY_AT=60 BUSY_PROCS=2 UNISON_BIN=/path/to/other/unison bash benchmarks/busy_midway.sh OUT -- ...
#
# OUT must not exist (the run writes there through --out, added here). Run it on an otherwise quiet machine:
# the point is a slowdown this script makes, not one that happens to be there.
set -uo pipefail
OUT=${1:?usage: busy_midway.sh OUT -- unison train ...}
shift
[ "${1:-}" = "--" ] && shift
[ -e "$OUT" ] && { echo "busy_midway.sh: $OUT exists; give a new folder" >&2; exit 2; }
BUSY_AT=${BUSY_AT:-60} BUSY_PROCS=${BUSY_PROCS:-2}
if [ -n "${UNISON_BIN:-}" ] && [ "${1:-}" = "unison" ]; then shift; set -- "$UNISON_BIN" "$@"; fi

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); busy at ${BUSY_AT}s with $BUSY_PROCS spinning processes"
"$@" --out "$OUT" --no-progress &
train=$!
sleep "$BUSY_AT"
spinners=()
for _ in $(seq "$BUSY_PROCS"); do python3 -c "while True: pass" & spinners+=($!); done
wait "$train"
rc=$?
kill "${spinners[@]}" 2>/dev/null
wait 2>/dev/null
echo "training exit $rc"
grep -E "planned|re-planned|used .* of|kNN top-1" "$OUT/train.log" | cut -c1-260
python3 - "$OUT" <<'EOF'
import csv, json, sys
out = sys.argv[1]
rows = [r for r in csv.DictReader(open(f"{out}/metrics.csv")) if r.get("lr")]
peak = json.load(open(f"{out}/config.json")).get("resolved", {}).get("peak_lr")
last = rows[-1]
print(f"last logged step {last['step']}: lr {float(last['lr']):.4g}" + (f" ({float(last['lr']) / peak:.2%} of the peak"
      f" {peak:.4g})" if peak else ""))
EOF
