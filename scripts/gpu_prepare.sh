#!/usr/bin/env bash
# Build gpu_carry/, the one ignored folder that travels with the working tree to a lent GPU machine (no network
# there): the wheels its image lacks (Python 3.12, manylinux x86-64: simplejpeg, braceexpand, Lightly SSL and the
# one dependency of it that Lightly's import needs beyond the image) and CIFAR-10 as two packs (train 45,000 and
# val 5,000 JPEGs, their bytes plus an index: unison.data.pack). Prints what will travel; fails above 60 MiB.
#
#   scripts/gpu_prepare.sh                     # data from ../shared/data/cifar10 (or $CIFAR10)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CIFAR10=${CIFAR10:-../shared/data/cifar10}
CARRY=gpu_carry
WHEELS="simplejpeg==1.9.0 braceexpand==0.1.7 lightly==1.6.0 lightning-utilities==0.15.3"
[ -d "$CIFAR10/train" ] && [ -d "$CIFAR10/val" ] || { echo "error: no $CIFAR10/{train,val}; set CIFAR10=PATH" >&2; exit 1; }
rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
# --no-deps: the image has torch, torchvision, timm, numpy, Pillow, tqdm, PyYAML; Lightly's import needs only these.
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --dest "$CARRY/wheels" $WHEELS
export PYTHONPATH=src
"$PY" benchmarks/gpu_proof.py pack "$CIFAR10/train" "$CARRY/cifar10-train.pack"
"$PY" benchmarks/gpu_proof.py pack "$CIFAR10/val" "$CARRY/cifar10-val.pack"
ls -l "$CARRY" "$CARRY/wheels"
"$PY" benchmarks/gpu_proof.py size "$CARRY"
