"""The lines rank 0 prints as a run starts, each about what is not the plain default: streamed data, images of
several sizes, a skipped kNN, the user's own dataset (`describe_data`), a ViT whose patches leave too coarse a grid
at the run's image size (`describe_backbone`), and what ``--init`` loaded (`describe_init`)."""

from __future__ import annotations

import sys
from typing import Any

from unison.models.backbones import patch_size_of
from unison.models.vit import coarse_grid
from unison.training.step import Run

__all__ = ["describe_backbone", "describe_data", "describe_init"]


def describe_data(run: Run) -> None:
    """One line on rank 0 for what is not the in-memory default: images of several sizes (the view size chosen),
    streamed data, and a skipped kNN."""
    d = run.data
    if d.size_note:
        print(f"unison: {d.size_note}", file=sys.stderr, flush=True)
    if d.mode == "stream":
        src: Any = d.source   # StreamingBatches
        print(f"unison: streaming {d.num_images} images from {run.cfg.data} at {d.image_size} px: "
              f"{src.loader_workers} loader process(es) per worker, decode on {src.decode_on}", file=sys.stderr,
              flush=True)
    if d.mode == "own":
        transform = d.own.transform
        views = (f"views by your transform {getattr(transform, '__name__', type(transform).__name__)}"
                 if transform is not None else f"unison's {d.augment.preset} augmentation")
        print(f"unison: training on your dataset {d.own.name} ({d.num_images} images) at {d.image_size} px, {views}",
              file=sys.stderr, flush=True)
    if d.knn_skipped:
        print(f"unison: kNN evaluation skipped: {d.knn_skipped}", file=sys.stderr, flush=True)


def describe_backbone(run: Run) -> None:
    """A warning on rank 0 when the run's ViT (unison's or timm's) has fewer than 8 x 8 patches at the run's image
    size (`unison.models.vit.coarse_grid`): ``--backbone vit_tiny`` at 32 px trains on 4 tokens."""
    cfg = run.cfg
    name = run.resolved["backbone"]
    if not (name.startswith("vit_") or name.startswith("timm:")):
        return
    note = coarse_grid(cfg.backbone or name, patch_size_of(name, run.image_size, cfg.backbone_args), run.image_size)
    if note:
        print(f"unison: warning: {note}", file=sys.stderr, flush=True)


def describe_init(run: Run) -> None:
    """One line on rank 0 for ``--init``: what was loaded, or that the resumed checkpoint's weights stand."""
    cfg, init = run.cfg, run.resolved.get("init")
    if isinstance(init, dict) and "report" in init and not cfg.resume:
        print(f"unison: --init: {init['report']}", file=sys.stderr, flush=True)
    elif cfg.init and cfg.resume:
        print(f"unison: --init {cfg.init} not read: the run resumes from {cfg.resume}, whose checkpoint holds the "
              "weights", file=sys.stderr, flush=True)
