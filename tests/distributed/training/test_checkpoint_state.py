"""Complete and asynchronous checkpoints: the extra state a checkpoint carries (GradScaler, per-rank state), and the
background writer (snapshot isolation, failures surfaced, abort without a half-written file)."""

from __future__ import annotations

import pytest
import torch

from unison.equivalence import assert_states_close
from unison.training.checkpoint import (
    load_checkpoint,
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 GradScaler only acts on CUDA; no GPU on this machine")
def test_fp16_run_with_grad_scaler_resumes_identically(tmp_path):
    from unison.cli import main

    tiny = ["train", "--world-size", "1", "--amp", "fp16", "--batch-size", "64", "--subset", "256", "--val-subset",
            "64", "--knn-k", "5", "--no-progress", "--max-steps", "6", "--checkpoint-every", "3", "--deterministic"]
    assert main([*tiny, "--out", str(tmp_path / "ref")]) == 0
    mid = tmp_path / "ref" / "checkpoints" / "step_00000003.pt"
    assert "grad_scaler" in load_checkpoint(mid)["extra"]
    assert main(["train", "--resume", str(mid), "--out", str(tmp_path / "resumed"), "--no-progress"]) == 0
    a, b = load_checkpoint(tmp_path / "resumed"), load_checkpoint(tmp_path / "ref")
    assert a["extra"]["grad_scaler"] == b["extra"]["grad_scaler"]   # scale and growth tracker continue exactly
    assert_states_close(a["model"], b["model"], 1e-5, "model")     # float32 on a GPU: deterministic kernels, not bits
