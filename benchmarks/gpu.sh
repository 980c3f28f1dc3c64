#!/usr/bin/env bash
# Lightly's distributed table on GPUs: ResNet-18, CIFAR-10, global batch 512, kNN k=200, 1 GPU vs
# 4 GPUs with SyncBN + gather vs 4 GPUs with gather only, for simclr, moco, simsiam, barlowtwins,
# byol and swav; plus the communication report, the Lightly comparison and scaling.
# 100 epochs by default (`--epochs 200`, `--workers 8`, `--train-args "--amp bf16"` to change);
# `--dry-run` prints the training commands. Output: runs/bench/gpu/report.md (+ CSV, PNG); a run again into
# it replaces the earlier results only with `--overwrite`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/unison bench all --preset gpu "$@"
