#!/usr/bin/env bash
# The GPU proof, in one call on a lent GPU machine (no network; Python 3.12 and torch there): installs the
# carried wheels, then runs four time-boxed phases (GPU tests, throughput against Lightly, `unison plan` against
# the measured peak, time to accuracy), each writing its result as soon as it ends, and after each one
# proof.json + proof.md into $OUT (three files come back: those and gpu_proof.log); the phases work in
# $UNISON_PROOF_WORK (default runs/gpu_proof: runs, checkpoints, per-phase records). docs/benchmarks.md, "GPU".
#
#   bash benchmarks/gpu_proof.sh                       # on the GPU: 8 minutes in all (--budget-s 480)
#   bash benchmarks/gpu_proof.sh --device cpu --tiny   # the dry run: every phase's code, tiny work, under 60 s
#
# Needs gpu_carry/ from scripts/gpu_prepare.sh (the dry run makes its own tiny data without it).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda TINY="" BUDGET=480
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY="--tiny"; shift ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    *) echo "gpu_proof.sh: unknown argument $1 (use --device cuda|cpu, --tiny, --budget-s N)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_proof}
WORK=${UNISON_PROOF_WORK:-runs/gpu_proof}
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/phase-*.json "$WORK"/phase-*.status "$WORK"/proof.json "$WORK"/proof.md
START=$(date +%s)
DEADLINE=$((START + BUDGET))
SITE=${TMPDIR:-/tmp}/unison_gpu_site

export PYTHONPATH="src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Time boxes (s). The dry run's are safety nets for a loaded CI machine (its own CPU time is about 40 s).
if [ -n "$TINY" ]; then LIMITS="tests:120 throughput:240 plan:120"; else LIMITS="tests:100 throughput:170 plan:60"; fi

phase() {   # phase NAME SECONDS: time-boxed; a phase killed before writing its record leaves a marker instead
  echo "== phase $1 (at most $2 s) =="
  timeout --kill-after=10 "$2" "$PY" benchmarks/gpu_proof.py phase "$1" --out "$WORK" --device "$DEVICE" $TINY \
    --deadline "$DEADLINE"
  rc=$?
  if [ ! -f "$WORK/phase-$1.json" ]; then
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "timed out after $2 s" > "$WORK/phase-$1.status"
    else echo "exited with $rc before writing its result" > "$WORK/phase-$1.status"; fi
  fi
  report
}
report() { "$PY" benchmarks/gpu_proof.py report --out "$WORK" && cp "$WORK"/proof.json "$WORK"/proof.md "$OUT"/ 2>/dev/null; }

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
  for item in $LIMITS; do phase "${item%%:*}" "${item##*:}"; done
  LEFT=$((DEADLINE - $(date +%s)))
  [ -n "$TINY" ] && LEFT=180
  if [ "$LEFT" -gt 20 ]; then phase accuracy "$LEFT"; else echo "no time left" > "$WORK/phase-accuracy.status"; report; fi
  echo "== proof: $OUT/proof.md, $OUT/proof.json ($(( $(date +%s) - START )) s) =="
  cat "$OUT/proof.md"
}
main 2>&1 | tee "$OUT/gpu_proof.log"
