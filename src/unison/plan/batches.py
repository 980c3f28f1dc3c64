"""The stand-ins of a run's data in a simulated step: its training images (one stored image, however many) and
one step's micro-batches of fake views, at the run's sizes (`unison.plan.simulate`, `unison.plan.cuda_check`)."""

from __future__ import annotations

from typing import Any

import torch

from unison.config import TrainConfig

__all__ = ["micro_batches", "step_images", "synthetic_train_set"]


def synthetic_train_set(images: int) -> Any:
    """`images` training images of 8 px, all one stored image (an expanded view: a batch of 2**24 allocates
    nothing): `build_run` checks one batch and one step against the count, `micro_batches` makes the views."""
    from unison.data.tensor_dataset import ImageTensorDataset

    pixels = torch.zeros(1, 3, 8, 8, dtype=torch.uint8).expand(images, 3, 8, 8)
    return ImageTensorDataset(pixels, torch.zeros(1, dtype=torch.int64).expand(images), ["none"], (0.5,) * 3,
                              (0.25,) * 3, "planned")


def step_images(cfg: TrainConfig, images: int | None) -> int:
    """The training images of a simulated run: the data's (`plan`), at least one step's."""
    return max(images or 0, cfg.batch_size * cfg.distributed.grad_sync_every)


def micro_batches(run: Any, local: int, device: torch.device) -> list[Any]:
    """One step's `run.accumulate` local micro-batches of random views of the run's sizes, dtype and memory
    format (fake tensors), with distinct sample indices."""
    from unison.training.step import Batch

    micro = []
    for m in range(run.accumulate):
        views = [torch.randn(local, 3, s, s, device=device, dtype=run.dtype) for s in run.augment.view_sizes]
        if run.cfg.nhwc:
            views = [v.contiguous(memory_format=torch.channels_last) for v in views]
        micro.append(Batch(0, m, 0, torch.arange(m * local, (m + 1) * local, device=device), views))
    return micro
