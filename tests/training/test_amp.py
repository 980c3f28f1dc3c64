"""--amp on the CPU (issue 22, defect 5): bf16 autocasts there (it was a silent no-op), fp16 is refused in one line."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from unison.cli import main

_TINY = ["train", "--world-size", "1", "--max-steps", "1", "--batch-size", "8", "--subset", "32", "--val-subset", "16",
         "--knn-k", "5", "--no-progress", "--no-random-init-knn"]


def _loss(run_dir) -> float:
    with open(run_dir / "metrics.csv") as f:
        return next(float(r["loss"]) for r in csv.DictReader(f) if r["loss"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's autocast: on a CUDA machine the run is on the GPU")
def test_bf16_on_cpu_autocasts_and_config_records_it(tmp_path):
    losses = {}
    for amp in ("none", "bf16"):
        assert main([*_TINY, "--amp", amp, "--out", str(tmp_path / amp)]) == 0
        losses[amp] = _loss(tmp_path / amp)
        assert json.loads((tmp_path / amp / "config.json").read_text())["amp"] == amp
    assert torch.isfinite(torch.tensor(losses["bf16"]))
    assert losses["bf16"] != losses["none"]          # bit-identical before: autocast was CUDA-only
    assert abs(losses["bf16"] - losses["none"]) < 0.1 * abs(losses["none"])


def test_fp16_without_cuda_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*_TINY, "--amp", "fp16", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("unison: error:") == 1 and "Traceback" not in err
    assert "amp='fp16' is for CUDA GPUs" in err and "--amp bf16" in err
    assert not (tmp_path / "r").exists()
