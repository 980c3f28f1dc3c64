#!/usr/bin/env bash
# Create .venv (if missing) and install unison with its dependencies. Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch/torchvision pinned to the versions this project is tested with (CPU or CUDA builds both work).
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1 2>&1 | grep -v "^WARNING: Location" || true
fi
# Every time: a no-op when nothing changed, and it picks up dependencies added to pyproject.toml since.
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchvision, unison, pytest, xdist" || { echo "setup failed: see the pip output above" >&2; exit 1; }
