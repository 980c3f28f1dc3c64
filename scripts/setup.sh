#!/usr/bin/env bash
# Create .venv (if missing) and install unison with its dependencies. Idempotent: the first run shows what the
# installer does (torch alone is minutes of download); a later one installs nothing unless pyproject.toml changed.
#
#   bash scripts/setup.sh main   what the main job needs (unison and its runtime dependencies): ./run.sh
#   bash scripts/setup.sh        that and the test toolchain (the `test` extra: pytest, ruff, mypy, mkdocs, Lightly
#                                for the benchmarks' cross-checks): scripts/test.sh, and a developer's checkout
#
# A checkout set up for the tests is set up for the main job too; one set up for the main job gets the rest the
# first time the tests run.
#
# The installer is uv (`uv pip install`, given the indexes pip is configured with): it resolves and installs torch
# and the dependencies in parallel, well ahead of pip, bytecode compiled in both. Where uv cannot be had, or fails,
# pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
FOR=${1:-test}
case $FOR in
  main) EXTRAS=""; CHECK="torch, torchvision, unison"; COMPILE=(src) ;;
  test) EXTRAS="[test]"; CHECK="torch, torchvision, unison, pytest, xdist"; COMPILE=(src tests benchmarks) ;;
  *) say "unknown set-up '$FOR': give main (the main job's needs) or nothing (also the test toolchain)"; exit 2 ;;
esac
# the installer's lines, without the one warning a shared venv repeats; --line-buffered: progress as it happens
shown() { grep --line-buffered -v "^WARNING: Location" || true; }
hash_of() { { sha256sum "$1" 2>/dev/null || shasum -a 256 "$1"; } | cut -d' ' -f1; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# pip's own configuration (PIP_CONFIG: `pip config list`, i.e. pip.conf and PIP_* variables) as uv's options: the
# same indexes, links, constraints and trusted hosts (pip's proxy and certificate: `choose_installer`)
uv_options() {
  local line key value
  while IFS= read -r line; do
    key=${line%%=*}; key=${key##*.}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    case $key in
      index-url) echo "--index-url"; echo "$value" ;;
      extra-index-url|find-links|constraint) for v in $value; do echo "--$key"; echo "$v"; done ;;
      trusted-host) for v in $value; do echo "--allow-insecure-host"; echo "$v"; done ;;
      no-index) case $value in 1|true|yes|on) echo "--no-index" ;; esac ;;
    esac
  done <<< "$PIP_CONFIG"
}
pip_setting() { sed -n "s/^.*\.$1='\(.*\)'$/\1/p" <<< "$PIP_CONFIG" | head -1; }
PIP_INSTALL=(.venv/bin/pip install --disable-pip-version-check)
INSTALL=()
choose_installer() {   # INSTALL: uv where it can be had (pip installs it into .venv once), else pip
  [ ${#INSTALL[@]} -gt 0 ] && return
  INSTALL=("${PIP_INSTALL[@]}")
  [ -x .venv/bin/uv ] || "${PIP_INSTALL[@]}" -q uv 2>&1 | shown || return 0
  [ -x .venv/bin/uv ] || return 0
  local from cert proxy
  PIP_CONFIG=$(.venv/bin/pip config list 2>/dev/null || true)   # read once: uv's options, certificate and proxy
  mapfile -t from < <(uv_options)
  cert=$(pip_setting cert); proxy=$(pip_setting proxy)
  [ -z "$cert" ] || export SSL_CERT_FILE="$cert"
  [ -z "$proxy" ] || export HTTPS_PROXY="${HTTPS_PROXY:-$proxy}" HTTP_PROXY="${HTTP_PROXY:-$proxy}"
  # unsafe-best-match: every index considered for every package, as pip does; bytecode compiled, as pip does
  INSTALL=(.venv/bin/uv pip install --python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match
           "${from[@]}")
}
install_packages() {   # the chosen installer; where uv fails (a pip setting it does not take, say), pip after it
  choose_installer
  "${INSTALL[@]}" "$@" 2>&1 | shown && return 0
  [ "${INSTALL[0]}" = .venv/bin/uv ] || return 1
  say "uv could not install $* (its output is above): installing with pip instead"
  INSTALL=("${PIP_INSTALL[@]}")
  "${INSTALL[@]}" "$@" 2>&1 | shown
}
# torch/torchvision pinned to the versions this project is tested with (CPU or CUDA builds both work).
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  say "installing torch 2.14.1 and torchvision 0.29.1 (the first time: a few minutes, mostly download)"
  install_packages torch==2.14.1 torchvision==0.29.1 \
    || { say "installing torch failed: see the installer's output above"; exit 1; }
fi
# The editable install of this checkout and the dependencies of pyproject.toml (with the `test` extra for the
# tests): skipped when the stamp says it was done for this pyproject.toml, this checkout and this set-up (or the
# tests', which holds the main job's), and unison still imports from here; a dependency added to pyproject.toml
# changes its hash, so the next run installs it.
STAMP=.venv/.unison-install-stamp
WANT="$(hash_of pyproject.toml) $PWD"
HAVE=$(cat "$STAMP" 2>/dev/null || true)
HERE="import os, sys, $CHECK; sys.exit(not os.path.realpath(unison.__file__).startswith(sys.argv[1]))"
case "$HAVE" in "$WANT test") DONE=test ;; "$WANT main") DONE=main ;; *) DONE="" ;; esac
if { [ "$DONE" = test ] || [ "$DONE" = "$FOR" ]; } && .venv/bin/python -c "$HERE" "$(pwd -P)/src/" 2>/dev/null; then
  say "unison and its dependencies are up to date (pyproject.toml unchanged)"
else
  rm -f "$STAMP"
  DONE=$FOR
  say "installing unison from $PWD and the dependencies of pyproject.toml${EXTRAS:+ with the test toolchain}"
  install_packages -e ".$EXTRAS" \
    || { say "installing unison failed: see the installer's output above"; exit 1; }
fi
.venv/bin/python -c "import $CHECK" || { say "failed: see the installer's output above"; exit 1; }
echo "$WANT $DONE" > "$STAMP"
# unison's own modules compiled to bytecode once, as an installer does for installed packages (an editable install
# does not): where PYTHONDONTWRITEBYTECODE is set, every process would compile them again.
# Only changed files are compiled again; a stale file is recompiled in memory by Python, never used as it is.
.venv/bin/python -m compileall -q "${COMPILE[@]}" > /dev/null || say "compiling unison's bytecode failed (it runs, only slower)"
