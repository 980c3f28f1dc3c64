"""The frozen teacher of ``--method distill``: its file checked before any worker starts, built in every worker.

``--teacher`` names

* a unison run directory or checkpoint (``step_N.pt`` / ``step_N.dcp``): its backbone as trained; the
  architecture is the run's (`resolve_teacher` records it in ``teacher_backbone``; another one is refused);
* a weights file (torchvision / timm state dict, ``.safetensors``, a unison export) together with
  ``--teacher-backbone NAME``: read by `unison.models.weights` as ``--init`` reads it (no code run);
* ``random``: a random-init teacher of ``--teacher-backbone`` (default ``small_cnn``), seeded with ``--seed``:
  what ``unison check --method distill`` runs (its exactness is the student's gradient's, whatever the teacher).

The names (method, ``--teacher`` given, ``--teacher-backbone``) are checked by
`unison.training.resolve.validate_teacher`; `unison.training.preflight.resolve_teacher` then reads a teacher run's
checkpoint (every field checked, as a resume would), pins ``--teacher`` to that checkpoint file and records its
backbone in ``teacher_backbone``; `build_teacher` (called by `unison.training.step.build_method` in every worker)
reads that file (``torch.load(weights_only=True)``). ``weights=False`` (`load_method`, the memory estimate) builds
the architecture only: a distilled run's checkpoint holds its teacher, so eval/export need no teacher file.

Example::

    net, dim = build_teacher(cfg, image_size=32)     # cfg validated and resolved by the pre-flight
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from unison.config import TrainConfig
from unison.errors import CheckpointError
from unison.methods import get_method
from unison.models.backbones import build_backbone, resolve_backbone
from unison.models.weights import load_backbone_weights, load_state, unwrap
from unison.training.checkpoint.files import is_checkpoint_name, latest_checkpoint, named_checkpoint
from unison.training.checkpoint.safe_load import load_file

RANDOM = "random"
DEFAULT_RANDOM_BACKBONE = "small_cnn"


def needs_teacher(method: str) -> bool:
    return bool(getattr(get_method(method), "needs_teacher", False))


def is_teacher_run(teacher: str) -> bool:
    """A unison run directory or checkpoint (as opposed to a weights file or ``random``)."""
    path = Path(teacher)
    return teacher != RANDOM and (path.is_dir() or is_checkpoint_name(path))


def read_teacher_run(teacher: str) -> dict:
    """The checkpoint dict of a teacher run (its latest checkpoint) or checkpoint file, read safely.
    (The checkpoint package's validated reader imports the training step, which imports this module.)"""
    path = named_checkpoint(teacher)
    if path.is_dir() and not is_checkpoint_name(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"--teacher {teacher} holds no checkpoint; give a finished run or a checkpoint")
        path = latest
    if path.is_dir():
        raise CheckpointError(f"--teacher {path} is a sharded (.dcp) checkpoint; give a .pt checkpoint of the run or "
                              "its unison export (with --teacher-backbone)")
    return load_file(path)


def teacher_run_backbone(ckpt: dict) -> str:
    """The backbone a run trained, pinned (as `unison.training.load.load_method` rebuilds it)."""
    pinned = (ckpt.get("resolved") or {}).get("backbone")
    return pinned or resolve_backbone(dict(ckpt["config"]).get("backbone") or DEFAULT_RANDOM_BACKBONE, None)


def build_teacher(cfg: TrainConfig, image_size: int | None, *, weights: bool = True) -> tuple[nn.Module, int]:
    """The teacher network and its width; `weights=False`: the architecture only (a distilled run's checkpoint
    holds the teacher's weights)."""
    run = cfg.teacher is not None and is_teacher_run(cfg.teacher)
    ckpt = read_teacher_run(str(cfg.teacher)) if run and (weights or cfg.teacher_backbone is None) else None
    name = cfg.teacher_backbone or (teacher_run_backbone(ckpt) if ckpt is not None else DEFAULT_RANDOM_BACKBONE)
    net, dim = build_backbone(name, image_size)
    if not weights or cfg.teacher in (None, RANDOM):
        return net, dim
    if ckpt is not None:   # the run's backbone, as trained, matched as --init matches it (a removed pool: no tensors)
        model = unwrap(ckpt["model"], str(cfg.teacher), "--teacher")
        state = {k[len("backbone."):]: v for k, v in model.items() if k.startswith("backbone.")}
        load_state(net, state, str(cfg.teacher), f"unison checkpoint ({ckpt.get('method')})", option="--teacher",
                   name=name)
    else:
        load_backbone_weights(net, cfg.teacher, option="--teacher", name=name)
    return net, dim
