"""The backbone before training: ``--init`` weights, ``--freeze``, ``--layer-decay``, one rule for the pre-flight
and the workers.

`prepare_backbone(backbone, cfg, name)` runs on the freshly built backbone, before the method is built around it
(so a momentum encoder or teacher copies the loaded weights) and before DDP/FSDP wrapping (so ``--shard full``
shards the loaded weights): the workers' build (`unison.training.step.build_method`) calls it on the real
backbone, the pre-flight (`check_backbone_setup`) on one built on the meta device (no memory: the file is read
and matched, the names checked, nothing stored). It returns what the run records in ``resolved`` (config.json,
the checkpoints): the ``--init`` file, its source, the tensors matched and skipped and their SHA-256.

``--init`` reads (`init_backbone`):

* a weights file (`unison.models.weights.load_backbone_weights`): torchvision/timm state dicts, safetensors,
  unison exports;
* a unison run directory (its latest checkpoint) or checkpoint (``step_N.pt``, ``step_N.dcp``): read with the
  checks of every checkpoint read (`unison.training.checkpoint.load_checkpoint`), its ``backbone.*`` tensors.

A resumed run (``--resume``, or a restart) does not read ``--init``: its checkpoint holds the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.models.weights import WeightsReport, load_backbone_weights, load_state, unwrap
from unison.optim.groups import freeze, layer_scales
from unison.training.checkpoint import load_checkpoint
from unison.training.checkpoint.files import is_checkpoint_name


def init_backbone(backbone: nn.Module, path: str | Path, *, name: str | None = None,
                  option: str = "--init") -> WeightsReport:
    """Load `path` (a weights file, or a unison run directory / checkpoint) into `backbone`; one line on failure."""
    path = Path(path)
    if not (path.is_dir() or is_checkpoint_name(path)):
        return load_backbone_weights(backbone, path, option=option, name=name)
    ckpt = load_checkpoint(path, map_location="cpu", run=True)   # every field checked, no code run
    model = unwrap(ckpt["model"], path, option)
    state = {k[len("backbone."):]: v for k, v in model.items() if k.startswith("backbone.")}
    if not state:
        return load_state(backbone, model, str(path), "unison checkpoint", option=option, name=name)
    report = load_state(backbone, state, str(path), f"unison checkpoint ({ckpt['method']}, step {ckpt['step']})",
                        option=option, name=name)
    others = len(model) - len(state)
    report.skipped = [f"the method's other {others} tensors (heads, momentum encoder)"] if others else []
    return report


def prepare_backbone(backbone: nn.Module, cfg: TrainConfig, name: str) -> dict[str, Any]:
    """``--init`` (unless resuming), ``--freeze``, ``--layer-decay`` checked against the backbone; the record."""
    record: dict[str, Any] = {}
    if cfg.init and not cfg.resume:
        report = init_backbone(backbone, cfg.init, name=name)
        record["init"] = {"path": str(cfg.init), "source": report.source[:200], "matched": report.matched,
                          "skipped": report.skipped[:8], "skipped_count": len(report.skipped),
                          "sha256": report.sha256, "report": report.line()[:1000]}
    names = [n for n, _ in backbone.named_parameters()]
    if cfg.freeze:
        record["frozen_parameters"] = len(freeze(backbone, cfg.freeze))
    if cfg.layer_decay is not None:
        layer_scales(names, cfg.layer_decay)   # the backbone has numbered blocks (the step builds the groups)
    return record


def check_backbone_setup(cfg: TrainConfig, backbone: str, image_size: int | None) -> None:
    """The pre-flight of `prepare_backbone`: the same rule on the backbone built on the meta device."""
    if not (cfg.init or cfg.freeze or cfg.layer_decay is not None):
        return
    from unison.models import build_backbone
    from unison.models.backbones import resolve_backbone

    with torch.device("meta"):
        net, _ = build_backbone(backbone, image_size, backbone_args=cfg.backbone_args)
    prepare_backbone(net, cfg, resolve_backbone(backbone, image_size))
