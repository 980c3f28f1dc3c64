"""The README's own-loop example (issue 22, item 12): unison's NT-Xent in a plain DDP loop under torchrun equals one
process on the global batch, step by step (float64, relative 1e-10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"


def _losses(argv: list[str], out: Path) -> list[float]:
    proc = subprocess.run([sys.executable, *argv, str(EXAMPLE), "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_own_ddp_loop_with_unison_losses_equals_one_process(tmp_path):
    two = _losses(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], tmp_path / "two.json")
    one = _losses([], tmp_path / "one.json")
    assert len(one) == len(two) == 5 and one[0] != one[-1]   # it trains: the losses move
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-10 * abs(b), (two, one)
