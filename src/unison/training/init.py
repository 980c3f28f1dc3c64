"""The backbone before training: ``--init`` weights, ``--freeze``, ``--layer-decay``, one rule for the pre-flight
and the workers.

`prepare_backbone(backbone, cfg, name, weights)` runs on the freshly built backbone, before the method is built
around it (so a momentum encoder or teacher copies the loaded weights) and before DDP/FSDP wrapping (so ``--shard
full`` shards the loaded weights): the workers' build (`unison.training.step.build_method`) calls it on the real
backbone, the pre-flight (`unison.training.init_read.check_backbone_setup`) on one built on the meta device (no
memory: the weights are matched, the names checked, nothing stored). It loads `weights` (`InitWeights`, read by
`unison.training.init_read.read_init` from a weights file or a unison run/checkpoint), freezes the ``--freeze``
parameters (``requires_grad=False``: the method, the SyncBN conversion and DDP/FSDP keep it), checks that
``--layer-decay`` finds numbered blocks, and returns what the run records in ``resolved`` (config.json, the
checkpoints, summary.json): the ``--init`` file, its source, the tensors matched and skipped and their SHA-256.

A resumed run (``--resume``, or a restart) reads no ``--init``: its checkpoint holds the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.optim.groups import freeze, layer_scales


@dataclass
class InitWeights:
    """``--init``'s tensors, read once (`unison.training.init_read.read_init`), with what they are."""

    path: str
    source: str                                  # "state dict", "unison export (...)", "unison checkpoint (...)"
    state: dict[str, torch.Tensor]
    skipped: list[str] = field(default_factory=list)   # left out before matching (a checkpoint's heads)


def prepare_backbone(backbone: nn.Module, cfg: TrainConfig, name: str,
                     weights: InitWeights | None = None) -> dict[str, Any]:
    """Load `weights`, freeze ``--freeze``, check ``--layer-decay`` against the backbone; the record for ``resolved``."""
    record: dict[str, Any] = {}
    if weights is not None:
        from unison.models.weights import load_state  # the weights reader: runs given --init only

        report = load_state(backbone, weights.state, weights.path, weights.source, name=name)
        report.skipped = weights.skipped + report.skipped
        record["init"] = {"path": weights.path, "source": report.source[:200], "matched": report.matched,
                          "skipped": report.skipped[:8], "skipped_count": len(report.skipped),
                          "sha256": report.sha256, "report": report.line()[:1000]}
    names = [n for n, _ in backbone.named_parameters()]
    if cfg.freeze is not None:   # before the method (and SyncBN, DDP/FSDP), which keep requires_grad as set here
        record["frozen_parameters"] = len(freeze(backbone, cfg.freeze))
    if cfg.layer_decay is not None:
        layer_scales(names, cfg.layer_decay)   # the backbone has numbered blocks (the step builds the groups)
    return record
