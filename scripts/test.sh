#!/usr/bin/env bash
# One command: set up (first time), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks    # lint (configured in pyproject.toml)
.venv/bin/mypy                               # types (configured in pyproject.toml)
# Two pytest workers, each taking whole files (their module-scoped reference runs are made once): most tests wait on
# worker processes, signals or timeouts, so two at a time fill a 2-core machine (UNISON_TEST_JOBS=0: one at a time).
exec .venv/bin/python -m pytest -q -n "${UNISON_TEST_JOBS:-2}" --dist loadfile "$@"
