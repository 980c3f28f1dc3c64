"""Checkpoints of sharded runs (torch.distributed.checkpoint): resume anywhere, export, atomic, safe to load.

Runs use float64: "continues identically" means 1e-9 relative to the uninterrupted run (another
world size sums in another order, so not bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from helpers.dcp_checkpoint import _Payload

from unison.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_non_tensor_entries_with_code_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from unison.training.checkpoint import load_safely

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "lr": 0.5, "hyper": _Payload(marker)}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    assert not marker.exists()
    plain = {"w": torch.zeros(3), "lr": None}
    load_safely(plain, tmp_path / "ckpt")             # tensors and plain values load
    assert plain["lr"] == 0.5 and torch.equal(plain["w"], torch.ones(3))
    with pytest.raises(CheckpointError, match="refusing to load hyper"):
        load_safely({"hyper": None}, tmp_path / "ckpt")
    assert not marker.exists()
