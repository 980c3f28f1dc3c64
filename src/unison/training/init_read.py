"""``--init PATH`` read from disk, and the pre-flight of `unison.training.init.prepare_backbone`.

`read_init(path)` reads, once per process, what ``--init`` names:

* a weights file (`unison.models.weights.read_backbone_state`): torchvision/timm state dicts, safetensors files,
  unison exports;
* a unison run directory (its latest checkpoint) or checkpoint (``step_N.pt``, ``step_N.dcp``): read with the
  checks of every checkpoint read (`unison.training.checkpoint.load_checkpoint`), its ``backbone.*`` tensors.

(The step, `unison.training.step`, cannot import the checkpoint package, which imports it: the training loop
reads ``--init`` here and hands the tensors to the build.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from unison.config import TrainConfig

from .init import InitWeights, prepare_backbone
from .pieces import OWN


def read_init(path: str | Path, option: str = "--init") -> InitWeights:
    """The tensors of `path` (a weights file, or a unison run directory / checkpoint); one line on failure."""
    from unison.models.weights import describe_file, read_backbone_state, unwrap  # the readers: runs given --init
    from unison.training.checkpoint import load_checkpoint
    from unison.training.checkpoint.files import is_checkpoint_name

    path = Path(path)
    if not (path.is_dir() or is_checkpoint_name(path)):
        state = read_backbone_state(path, option)
        return InitWeights(str(path), describe_file(path), state)
    ckpt = load_checkpoint(path, map_location="cpu", run=True)   # every field checked, no code run
    model = unwrap(ckpt["model"], path, option)
    state = {k[len("backbone."):]: v for k, v in model.items() if k.startswith("backbone.")}
    others = len(model) - len(state)
    return InitWeights(str(path), f"unison checkpoint ({ckpt['method']}, step {ckpt['step']})", state or model,
                       [f"the method's other {others} tensors (heads, momentum encoder)"] if state and others else [])


def init_weights_of(cfg: TrainConfig) -> InitWeights | None:
    """What the run starts its backbone from: ``--init`` read, unless the run resumes (its checkpoint holds them)."""
    return read_init(cfg.init) if cfg.init and not cfg.resume else None


def check_backbone_setup(cfg: TrainConfig, backbone: str, image_size: int | None) -> None:
    """The pre-flight of `prepare_backbone`: the same rule on the backbone built on the meta device."""
    if not (cfg.init or cfg.freeze is not None or cfg.layer_decay is not None) or backbone.startswith(OWN):
        return   # the user's own backbone: `unison.training.own.check_pieces` builds the method around it
    from unison.models import build_backbone
    from unison.models.backbones import resolve_backbone

    with torch.device("meta"):
        net, _ = build_backbone(backbone, image_size, backbone_args=cfg.backbone_args)
    prepare_backbone(net, cfg, resolve_backbone(backbone, image_size), init_weights_of(cfg))
