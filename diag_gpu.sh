#!/usr/bin/env bash
# one-off diagnostic (not committed): the compiled speed-run step on the GPU, full traceback on failure
set -u
SITE=/tmp/unison_gpu_site
python3 -m pip install --quiet --no-index --no-deps --target "$SITE" gpu_carry/wheels/*.whl
export PYTHONPATH="src:$SITE" UNISON_DEBUG=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "== compiled resnet18, threads default =="
timeout 150 python3 -c "from unison.cli import main; import sys; sys.exit(main(sys.argv[1:]))" train --preset speedrun --backbone resnet18 \
  --data gpu_carry/cifar10-val.pack --max-steps 60 --batch-size 512 --no-knn --world-size 1 --backend nccl \
  --out /tmp/diag1 --no-progress > "$OUT/diag1.log" 2>&1; echo "rc=$?"
tail -c 6000 "$OUT/diag1.log"
cat /tmp/diag1/summary.json 2>/dev/null | head -c 1500; echo
echo "== gpu tests =="
timeout 120 python3 -m pytest -q -x -m gpu tests/distributed/gpu -k "synchronises or compile or bf16" -p no:cacheprovider 2>&1 | tail -30
