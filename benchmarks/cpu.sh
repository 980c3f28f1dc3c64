#!/usr/bin/env bash
# The CPU benchmarks of docs/benchmarks.md: table, communication, Lightly comparison, scaling
# (about 15 minutes on 2 idle cores). Waits for a 1-minute load <= 1.5 before each
# measurement (15 min of waiting at most in all, then it measures anyway and records the load), because
# absolute CPU timings mean little on a busy machine. Extra flags pass through,
# e.g. `benchmarks/cpu.sh --methods simclr,moco,byol`. Output: runs/bench/cpu/report.md (+ CSV, PNG); a run
# again into it replaces the earlier results only with `--overwrite`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/unison bench all --preset cpu --max-load 1.5 --load-wait-s 900 "$@"
