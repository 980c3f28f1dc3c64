#!/usr/bin/env bash
# The GPU proof, in two calls on a lent GPU machine (no network; Python 3.12 and torch there): installs the
# carried wheels, then runs the chosen time-boxed phases (GPU tests, throughput against Lightly, `unison plan`
# against the measured peak, time to accuracy), each writing its result as soon as it ends (throughput also after
# each of its parts), and after each one proof.json + proof.md into $OUT (those, gpu_proof.log and the accuracy
# run's metrics come back); the phases work in $UNISON_PROOF_WORK (default runs/gpu_proof: runs, checkpoints,
# per-phase records, kept between calls on a warm machine). docs/benchmarks.md, "GPU".
#
#   bash benchmarks/gpu_proof.sh --phases step,accuracy           # on the GPU, call 1: the step, a 5-minute run
#   bash benchmarks/gpu_proof.sh --phases accuracy --accuracy-args "--param temperature=0.2"   # call 2: other values
#   bash benchmarks/gpu_proof.sh --phases tests,throughput,plan   # a loan with time for them: at most 385 s
#   bash benchmarks/gpu_proof.sh --device cpu --tiny              # the dry run: every phase, tiny work, under 60 s
#
# Needs gpu_carry/ from scripts/gpu_prepare.sh (the dry run makes its own tiny data without it).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda TINY="" BUDGET=900 PHASES="tests,throughput,plan,step,accuracy" ACCURACY_S=300 ACCURACY_ARGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY="--tiny"; shift ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --phases) PHASES="$2"; shift 2 ;;
    --accuracy-s) ACCURACY_S="$2"; shift 2 ;;
    --accuracy-args) ACCURACY_ARGS="$2"; shift 2 ;;
    *) echo "gpu_proof.sh: unknown argument $1 (use --device cuda|cpu, --tiny, --phases LIST, --accuracy-s N," \
         "--accuracy-args 'TRAIN OPTIONS', --budget-s N)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_proof}
WORK=${UNISON_PROOF_WORK:-runs/gpu_proof}
mkdir -p "$OUT" "$WORK"
for name in ${PHASES//,/ }; do
  case "$name" in tests|throughput|plan|step|accuracy) rm -f "$WORK/phase-$name.json" "$WORK/phase-$name.status" ;;
    *) echo "gpu_proof.sh: unknown phase $name (use tests, throughput, plan, step, accuracy)" >&2; exit 2 ;; esac
done
START=$(date +%s)
DEADLINE=$((START + BUDGET))
SITE=${TMPDIR:-/tmp}/unison_gpu_site

export PYTHONPATH="src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Time boxes (s). The dry run's are safety nets for a loaded CI machine (its own CPU time is about 40 s).
# Seen on an H100: tests 26 s, plan 22 s; throughput did not finish in 170 s while Lightly's loader workers were
# spawned (now forked, as a Lightly user's are).
if [ -n "$TINY" ]; then LIMITS="tests:120 throughput:240 plan:120 step:120"
else LIMITS="tests:100 throughput:240 plan:45 step:60"; fi

phase() {   # phase NAME SECONDS: time-boxed; a phase killed before writing its record leaves a marker instead
  echo "== phase $1 (at most $2 s) =="
  timeout --kill-after=10 "$2" "$PY" benchmarks/gpu_proof.py phase "$1" --out "$WORK" --device "$DEVICE" $TINY \
    --deadline "$DEADLINE" --accuracy-s "$ACCURACY_S" --accuracy-args="$ACCURACY_ARGS"
  rc=$?
  if [ ! -f "$WORK/phase-$1.json" ] || grep -q '"status": "partial"' "$WORK/phase-$1.json"; then
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "timed out after $2 s" > "$WORK/phase-$1.status"
    else echo "exited with $rc before writing its result" > "$WORK/phase-$1.status"; fi
  fi
  report
}
report() {
  "$PY" benchmarks/gpu_proof.py report --out "$WORK" && cp "$WORK"/proof.json "$WORK"/proof.md "$OUT"/ 2>/dev/null
  [ -f "$WORK/runs/accuracy/metrics.csv" ] && cp "$WORK/runs/accuracy/metrics.csv" "$OUT/accuracy-metrics.csv"
  [ -f "$WORK/runs/accuracy/train.log" ] && tail -c 200000 "$WORK/runs/accuracy/train.log" > "$OUT/accuracy-train.log"
  [ -f "$WORK/runs/accuracy/profile/rank0-ops.txt" ] && cp "$WORK/runs/accuracy/profile/rank0-ops.txt" "$OUT/accuracy-profile-ops.txt"
  return 0
}

install_wheels() {   # built for Python 3.12 (the device's); another Python (the dry run here) uses its own packages
  if [ -d gpu_carry/wheels ] && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" gpu_carry/wheels/*.whl \
      && echo "gpu_proof.sh: installed $(ls gpu_carry/wheels | tr '\n' ' ')" \
      || echo "gpu_proof.sh: installing the wheels failed; the phases that need them will say so"
  else
    echo "gpu_proof.sh: wheels not installed (gpu_carry/wheels: $([ -d gpu_carry/wheels ] && echo for Python 3.12 \
|| echo absent); this is $("$PY" -V 2>&1)): using this environment's packages"
  fi
}

main() {
  install_wheels
  for item in $LIMITS; do
    case ",$PHASES," in *",${item%%:*},"*) phase "${item%%:*}" "${item##*:}" ;; esac
  done
  case ",$PHASES," in *,accuracy,*)   # its budget, plus the process start and a margin past it
    LEFT=$((DEADLINE - $(date +%s)))
    BOX=$((ACCURACY_S + 40)); [ -n "$TINY" ] && BOX=180; [ "$BOX" -gt "$LEFT" ] && BOX=$LEFT
    if [ "$BOX" -gt 20 ]; then phase accuracy "$BOX"; else echo "no time left" > "$WORK/phase-accuracy.status"; report; fi ;;
  esac
  echo "== proof: $OUT/proof.md, $OUT/proof.json ($(( $(date +%s) - START )) s) =="
  cat "$OUT/proof.md"
}
main 2>&1 | tee "$OUT/gpu_proof.log"
