#!/usr/bin/env bash
# One command: set up (first time), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh   # the main job's needs and the test toolchain (pytest, ruff, mypy, mkdocs, Lightly)
.venv/bin/ruff check src tests benchmarks    # lint (configured in pyproject.toml)
.venv/bin/mypy                               # types (configured in pyproject.toml)
# Three pytest workers, each taking whole files (their module-scoped reference runs are made once): many tests wait
# on worker processes, signals or timeouts, so one more pytest worker than a 2-core machine's cores keeps its cores
# busy while some tests wait (UNISON_TEST_JOBS=0: one at a time).
# --no-loadscope-reorder: files in the order tests/conftest.py gives (the longest first); by default pytest-xdist
# (3.5+) hands out the files with the most tests first, whatever their length.
# --durations=30: every run (CI included) prints its slowest tests, the list to shorten when the suite grows.
exec .venv/bin/python -m pytest -q -n "${UNISON_TEST_JOBS:-3}" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
