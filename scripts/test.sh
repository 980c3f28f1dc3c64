#!/usr/bin/env bash
# One command: set up (first time), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks    # lint (configured in pyproject.toml)
.venv/bin/mypy                               # types (configured in pyproject.toml)
exec .venv/bin/python -m pytest -q "$@"
