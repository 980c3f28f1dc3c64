#!/usr/bin/env bash
# Create .venv (if missing) and install unison with its dependencies. Idempotent: the first run shows what pip
# does (torch alone is minutes of download); a later one installs nothing unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
# pip's lines, without the one warning a shared venv repeats; --line-buffered: progress as it happens
pip_shown() { grep --line-buffered -v "^WARNING: Location" || true; }
hash_of() { { sha256sum "$1" 2>/dev/null || shasum -a 256 "$1"; } | cut -d' ' -f1; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# torch/torchvision pinned to the versions this project is tested with (CPU or CUDA builds both work).
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  say "installing torch 2.14.1 and torchvision 0.29.1 (the first time: a few minutes, mostly download)"
  .venv/bin/pip install --disable-pip-version-check torch==2.14.1 torchvision==0.29.1 2>&1 | pip_shown \
    || { say "installing torch failed: see pip's output above"; exit 1; }
fi
# The editable install of this checkout and the dependencies of pyproject.toml: skipped when the stamp says it
# was done for this pyproject.toml and this checkout, and unison still imports from here; a dependency added
# to pyproject.toml changes its hash, so the next run installs it.
STAMP=.venv/.unison-install-stamp
WANT="$(hash_of pyproject.toml) $PWD"
HERE="import os, sys, unison, pytest, xdist; sys.exit(not os.path.realpath(unison.__file__).startswith(sys.argv[1]))"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && .venv/bin/python -c "$HERE" "$(pwd -P)/src/" 2>/dev/null; then
  say "unison and its dependencies are up to date (pyproject.toml unchanged)"
else
  rm -f "$STAMP"
  say "installing unison from $PWD and the dependencies of pyproject.toml"
  .venv/bin/pip install --disable-pip-version-check -e '.[test]' 2>&1 | pip_shown \
    || { say "installing unison failed: see pip's output above"; exit 1; }
fi
.venv/bin/python -c "import torch, torchvision, unison, pytest, xdist" || { say "failed: see the pip output above"; exit 1; }
echo "$WANT" > "$STAMP"
