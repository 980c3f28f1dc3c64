"""Helpers shared by the unit and distributed tests of test_dcp_checkpoint."""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path

import torch

from unison.config import TrainConfig
from unison.training.checkpoint.dcp import save_sharded


def small_sharded_checkpoint(run_dir: Path, step: int = 3, extra: dict | None = None) -> Path:
    """A ``.dcp`` checkpoint of a small linear model and SGD, written in this process (no process group: DCP
    saves as one rank)."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    run = types.SimpleNamespace(method=model, optimizer=opt, cfg=TrainConfig(method="byol", keep_checkpoints=2),
                                resolved={"backbone": "small_cnn"})
    with warnings.catch_warnings():   # DCP without a process group warns that it saves as one process
        warnings.simplefilter("ignore")
        return save_sharded(run, run_dir, step, {"knn_top1": 0.5}, extra)


# ------------------------------------------------------------------ loading never runs pickled code
class _Payload:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))
