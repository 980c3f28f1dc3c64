"""Helpers shared by the unit and distributed tests of ``unison eval --fine-tune`` / ``--linear-protocol standard``:
a checkpoint of a tiny SimCLR encoder on the embedded digits (16 px), and reading what an evaluation left."""

from __future__ import annotations

from pathlib import Path

import torch


def digits_checkpoint(run_dir: Path, backbone: str = "small_cnn") -> Path:
    """A freshly built SimCLR (non-trivial batch-norm statistics) saved as a unison checkpoint of a digits run."""
    from unison.config import TrainConfig
    from unison.methods import get_method
    from unison.models import build_backbone
    from unison.models.backbones import resolve_backbone
    from unison.training.checkpoint import save_checkpoint

    torch.manual_seed(0)
    net, dim = build_backbone(backbone, 16)
    cls = get_method("simclr")
    method = cls(net, dim, cls.Params())
    with torch.no_grad():
        for m in method.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    cfg = TrainConfig(backbone=backbone, data="digits").to_dict()
    state = {"method": "simclr", "config": cfg, "model": method.state_dict(),
             "resolved": {"backbone": resolve_backbone(backbone, 16), "image_size": 16}}
    save_checkpoint(run_dir, state, step=3)
    return run_dir


def classifier_state(folder: Path) -> dict[str, torch.Tensor]:
    """The classifier's tensors in an evaluation's ``checkpoint.pt``."""
    return torch.load(folder / "checkpoint.pt", weights_only=True)["model"]


def max_rel_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |a - b| / max(|b|, 1e-12 scale) over the floating tensors of two state dicts, and its name."""
    assert a.keys() == b.keys()
    worst, name = 0.0, ""
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        scale = b[k].abs().max().clamp_min(1e-12)
        d = float((a[k] - b[k]).abs().max() / scale)
        if d > worst:
            worst, name = d, k
    return worst, name
