#!/usr/bin/env bash
# Time to accuracy: the kNN top-1 on the CIFAR-10 val split that a fixed wall-clock budget buys with
# `--preset speedrun` (on a GPU: ResNet-18, bf16, --compile; on a CPU give a smaller --backbone).
#   benchmarks/time_to_accuracy.sh /data/cifar10 5m [extra unison train flags]
# Prints the result line; the run directory (runs/tta-<budget>) holds config.json (the plan under
# time_budget_plan: steps, warm-up, the measured costs), summary.json (kNN, budget used) and train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?"usage: $0 CIFAR10_DIR (with train/ and val/) BUDGET [flags]"}
budget=${2:-5m}
shift 2 || true
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || grep -m1 "model name" /proc/cpuinfo
cat /proc/loadavg
exec .venv/bin/unison train --preset speedrun --data "$data/train" --val "$data/val" --time-budget "$budget" \
    --out "runs/tta-$budget" --no-progress "$@"
