"""The lines rank 0 prints as a run starts, each about what is not the plain default: streamed data, images of
several sizes, a skipped kNN, the user's own dataset (`describe_data`), a ViT whose patches leave too coarse a grid
at the run's image size (`describe_backbone`), and what ``--init`` loaded (`describe_init`)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from unison.config.fields import count
from unison.distributed import collectives as C
from unison.models.backbones import patch_size_of
from unison.models.vit import coarse_grid
from unison.training.metrics import RunLog
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
    size (`unison.models.vit.coarse_grid`): ``--backbone vit_tiny`` at 32 px trains on 4 tokens. Only for a
    backbone the user named: a recipe's own choice (the embedded digits' ``vit_nano_p4``) was set for its data."""
    cfg = run.cfg
    name = run.resolved["backbone"]
    if cfg.backbone is None or not (name.startswith("vit_") or name.startswith("timm:")):
        return
    note = coarse_grid(cfg.backbone, patch_size_of(name, run.image_size, cfg.backbone_args), run.image_size)
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


class UnreadableImages:
    """Training images skipped as unreadable (``--on-corrupt skip``), reported once over all ranks.

    In memory every rank decodes all the images, and streamed each rank meets a file in whichever epoch its slice
    holds it: a warning per rank would name the same file once per worker, and record it nowhere. Here the ranks add
    up how many they found (one integer all-reduced, at every logged step, the end of each epoch and the start);
    when that changed, they exchange the new names, and rank 0 names the first `NAMED` files (then a count every
    100 more) on standard error and in ``train.log``. At the end: one line with the total, in both, and the count
    for ``summary.json`` (`total`)."""

    NAMED = 3

    def __init__(self, run: Run, runlog: RunLog) -> None:
        self.run, self.runlog = run, runlog
        self.found: dict[str, str] = {}   # over all ranks (on every rank alike): name -> why, in the order found
        self.shared: set[str] = set()     # this rank's names already exchanged
        self.counted = 0                  # the ranks' summed counts at the last exchange

    @property
    def total(self) -> int:
        return len(self.found)

    def exchange(self) -> None:
        """Every rank: learn the files the ranks found since the last exchange; rank 0 reports them."""
        mine = self.run.data.unreadable()
        counted = int(C.all_reduce_no_grad(torch.tensor([len(mine)], dtype=torch.int64, device=self.run.device)))
        if counted == self.counted:
            return
        self.counted = counted
        new = [(name, why) for name, why in mine.items() if name not in self.shared]
        self.shared.update(name for name, _ in new)
        for name, why in (item for found in C.all_gather_object(new) for item in found):
            if name not in self.found:
                self.found[name] = why
                self._said(self.total, name, why)

    def _said(self, k: int, name: str, why: str) -> None:
        if k <= self.NAMED:
            self._line(f"warning: skipped unreadable training image {name} ({why}); its views come from the next "
                       "readable image (--on-corrupt skip)" if self.run.data.mode == "stream" else
                       f"warning: skipped unreadable training image {name} ({why}); it is left out (--on-corrupt skip)")
        elif k == self.NAMED + 1 or k % 100 == self.NAMED + 1:
            self._line(f"warning: {k} unreadable training images skipped so far")

    def final(self) -> None:
        """The end of the run: the last exchange, and one line with the total over all ranks when there are any."""
        self.exchange()
        if self.found:
            names = list(self.found)
            shown = ", ".join(names[:self.NAMED]) + (f" and {len(names) - self.NAMED} more" if len(names) > self.NAMED
                                                      else "")
            self._line(f"{count(self.total, 'unreadable training image')} skipped in this run (--on-corrupt skip, "
                       f"over {count(C.world_size(), 'worker')}): {shown}")

    def _line(self, text: str) -> None:
        if C.rank() == 0:
            print(f"unison: {text}", file=sys.stderr, flush=True)
            self.runlog.line(text)
