#!/usr/bin/env bash
# Build the documentation site into build/site (open build/site/index.html in a browser), strictly: a dead link, a
# missing page, an API object that does not resolve or a documented `unison` command that no longer parses fails it.
# `bash scripts/docs.sh serve` serves it at http://127.0.0.1:8000 instead, rebuilding on every change.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_MKDOCS_2_WARNING=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = serve ]; then
  exec .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8000
fi
.venv/bin/mkdocs build --strict "$@"
echo "unison: documentation built: $PWD/build/site/index.html"
