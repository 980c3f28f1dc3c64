"""The frozen teacher of ``--method distill``: its file checked before any worker starts, built in every worker.

``--teacher`` names

* a unison run directory or checkpoint (``step_N.pt`` / ``step_N.dcp``): its backbone as trained; the
  architecture is the run's (`resolve_teacher` records it in ``teacher_backbone``; another one is refused);
* a weights file (torchvision / timm state dict, ``.safetensors``, a unison export) together with
  ``--teacher-backbone NAME``: read by `unison.models.weights` as ``--init`` reads it (no code run);
* ``random``: a random-init teacher of ``--teacher-backbone`` (default ``small_cnn``), seeded with ``--seed``:
  what ``unison check --method distill`` runs (its exactness is the student's gradient's, whatever the teacher).

``--param loss=dino`` also takes the teacher's DINO head (a dino or ibot run's ``head.``; ``random``: DINO's
default head, seeded): `teacher_head_spec` is the one rule on which teachers have one (the pre-flight and every
worker apply it), `build_teacher` returns the head with the network, and the run records the head's shape in its
config (`recorded_head_spec`), so eval/export rebuild it without the teacher.

The names (method, ``--teacher`` given, ``--teacher-backbone``) are checked by
`unison.training.resolve.validate_teacher`; `unison.training.preflight.resolve_teacher` then reads a teacher run's
checkpoint (every field checked, as a resume would), pins ``--teacher`` to that checkpoint file and records its
backbone in ``teacher_backbone``; `build_teacher` (called by `unison.training.step.build_method` in every worker)
reads that file (``torch.load(weights_only=True)``; a ``.dcp`` checkpoint consolidated by every worker, as
``--init`` and a resume read one). ``weights=False`` (`load_method`, the memory estimate) builds
the architecture only: a distilled run's checkpoint holds its teacher, so eval/export need no teacher file, and
neither does a resume (`unison.training.resolve.resumes_its_teacher`): a resumed run keeps the teacher its checkpoint
holds, ``--teacher`` naming another is refused (`unison.training.preflight.keep_resumed_teacher`).

Example::

    net, dim, head = build_teacher(cfg, image_size=32)     # cfg validated and resolved by the pre-flight
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.errors import CheckpointError, ConfigError
from unison.methods import get_method
from unison.models.backbones import build_backbone, resolve_backbone
from unison.models.weights import load_backbone_weights, load_state, unwrap
from unison.training.checkpoint.files import first_loadable, is_checkpoint_name, latest_checkpoint, named_checkpoint
from unison.training.checkpoint.safe_load import load_file
from unison.training.resolve import TEACHER_RANDOM

RANDOM = TEACHER_RANDOM
DEFAULT_RANDOM_BACKBONE = "small_cnn"


def is_teacher_run(teacher: str) -> bool:
    """A unison run directory or checkpoint (as opposed to a weights file or ``random``)."""
    path = Path(teacher)
    return teacher != RANDOM and (path.is_dir() or is_checkpoint_name(path))


def read_teacher_run(teacher: str) -> dict:
    """The checkpoint dict of a teacher run (its latest checkpoint) or checkpoint file, read safely.
    (The checkpoint package's validated reader imports the training step, which imports this module.)"""
    path = named_checkpoint(teacher)
    if path.is_dir() and not is_checkpoint_name(path):
        if latest_checkpoint(path) is None:
            raise CheckpointError(f"--teacher {teacher} holds no checkpoint; give a finished run or a checkpoint")
        return first_loadable(path, _read_teacher_checkpoint)   # past a damaged latest, as a resume falls back
    return _read_teacher_checkpoint(path)


def _read_teacher_checkpoint(path: Path) -> dict:
    if path.is_dir():   # a --shard full run's .dcp: consolidated (by every worker: a collective read); imported
        # here: torch.distributed.checkpoint is a slow import the launching process need not pay
        from unison.training.checkpoint.dcp_read import load_consolidated

        return load_consolidated(path)
    return load_file(path)


def teacher_run_backbone(ckpt: dict) -> str:
    """The backbone a run trained, pinned (as `unison.training.load.load_method` rebuilds it)."""
    pinned = (ckpt.get("resolved") or {}).get("backbone")
    return pinned or resolve_backbone(dict(ckpt["config"]).get("backbone") or DEFAULT_RANDOM_BACKBONE, None)


def teacher_head_spec(cfg: TrainConfig, ckpt: dict | None) -> dict[str, Any] | None:
    """The architecture of the teacher's DINO head that ``--param loss=dino`` distils through (`DINOHead`'s
    arguments; None for the other losses). The one rule on which teachers have one, applied by the pre-flight
    (`unison.training.preflight.resolve_teacher`, on the teacher run's checkpoint `ckpt`, or None for a weights
    file) and by every worker (`build_teacher`): a unison run of a method with a DINO head (dino, ibot), or
    ``random`` (DINO's default head, seeded). Head fields given with ``--param`` must be the teacher's."""
    from unison.methods.dino import DINOParams  # here: a run without a teacher imports no DINO code
    from unison.methods.distill import DINO_LOSS, HEAD_FIELDS, DistillParams, head_spec
    from unison.methods.distillation import SelfDistillation

    params = DistillParams(**cfg.method_params)
    if params.loss != DINO_LOSS:
        return None
    if cfg.teacher == RANDOM:
        spec = head_spec(DINOParams())
    else:
        method = ckpt.get("method") if ckpt is not None else None
        cls = get_method(method) if isinstance(method, str) else None
        trained = cls.Params(**dict(ckpt["config"]).get("method_params") or {}) if cls and ckpt else None
        # dino, ibot (and a student distilled with loss=dino): a DINO head as "head."
        if cls is None or not (issubclass(cls, SelfDistillation) or getattr(trained, "loss", None) == DINO_LOSS):
            what = f"a {method} run" if isinstance(method, str) else "a weights file"
            raise ConfigError(f"--param loss=dino distils through the teacher's DINO head, and --teacher {cfg.teacher} "
                              f"is {what} without one; give a unison run of --method dino or ibot, or leave "
                              "--param loss out (LightlyTrain's distillation of the features)")
        spec = head_spec(trained)
    wrong = [f for f, arg in HEAD_FIELDS.items() if f in cfg.method_params and getattr(params, f) != spec[arg]]
    if wrong:
        raise ConfigError(f"--param {wrong[0]}={getattr(params, wrong[0])} is not the teacher head's "
                          f"({spec[HEAD_FIELDS[wrong[0]]]}); leave the head's parameters out (the teacher's are used)")
    return spec


def recorded_head_spec(cfg: TrainConfig) -> dict[str, Any] | None:
    """The teacher head's architecture a distilled run recorded in its config (all its fields, a head that builds);
    None: not recorded (fields given with ``--param`` are checked against the teacher: `teacher_head_spec`)."""
    from unison.methods.distill import DINO_LOSS, HEAD_FIELDS, DistillParams, head_spec

    params = DistillParams(**cfg.method_params)
    if params.loss != DINO_LOSS or not set(HEAD_FIELDS) <= set(cfg.method_params):
        return None
    sizes = (params.out_dim >= 2, params.hidden_dim >= 1, params.bottleneck_dim >= 1, params.head_layers >= 1)
    return head_spec(params) if all(sizes) else None


def build_teacher(cfg: TrainConfig, image_size: int | None, *, weights: bool = True,
                  dtype: torch.dtype | None = None) -> tuple[nn.Module, int, nn.Module | None]:
    """The teacher network, its width and (``--param loss=dino``) its frozen DINO head; `weights=False`: the
    architecture only (a distilled run's checkpoint holds the teacher's weights, its config the head's shape).
    `dtype`: the run's, given to the modules before the weights are read into them (a float64 teacher read into
    float32 modules and cast back would lose its last digits)."""
    run = cfg.teacher is not None and is_teacher_run(cfg.teacher)
    recorded = None if weights else recorded_head_spec(cfg)
    needs_ckpt = weights or cfg.teacher_backbone is None or (recorded is None and _wants_head(cfg))
    ckpt = read_teacher_run(str(cfg.teacher)) if run and needs_ckpt else None
    name = cfg.teacher_backbone or (teacher_run_backbone(ckpt) if ckpt is not None else DEFAULT_RANDOM_BACKBONE)
    net, dim = build_backbone(name, image_size)
    spec = recorded or teacher_head_spec(cfg, ckpt)
    if spec is not None:
        from unison.methods.distillation import DINOHead
    head = DINOHead(dim, **spec) if spec is not None else None
    for module in (net, head):
        if module is not None and dtype is not None:
            module.to(dtype)
    if not weights or cfg.teacher in (None, RANDOM):
        return net, dim, head
    if ckpt is not None:   # the run's backbone, as trained, matched as --init matches it (a removed pool: no tensors)
        model = unwrap(ckpt["model"], str(cfg.teacher), "--teacher")
        for module, prefix in ((net, "backbone."), (head, "head.")):
            if module is not None:   # the run's own (backbone, head) pair, the one its kNN evaluated
                state = {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)}
                load_state(module, state, str(cfg.teacher), f"unison checkpoint ({ckpt.get('method')})",
                           option="--teacher", name=name if module is net else f"{ckpt.get('method')} head")
    else:
        load_backbone_weights(net, cfg.teacher, option="--teacher", name=name)
    return net, dim, head


def _wants_head(cfg: TrainConfig) -> bool:
    from unison.methods.distill import DINO_LOSS

    return str(cfg.method_params.get("loss")) == DINO_LOSS
