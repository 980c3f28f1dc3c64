"""Your own backbone, dataset and views in unison's loop (README, "Your own pieces"; docs/distributed.md).

    python examples/own_pieces.py ../shared/data/cifar10/train            # 2 workers, SimCLR, 10 steps
    python examples/own_pieces.py ../shared/data/cifar10/train --check    # unison check with the same objects

The pieces are module-level (a class, a Compose of torchvision transforms), so unison's worker processes can
unpickle them; `if __name__ == "__main__"` keeps the workers, which import this file, from training again.
"""

import argparse

import torch
import torch.nn as nn
import torchvision
from torchvision.transforms import v2

import unison
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig


class Backbone(nn.Module):
    """torchvision's ResNet-18 with a 32 px stem, without its classifier: [B, 3, 32, 32] -> [B, 512]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torchvision.models.resnet18()
        self.net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.net.maxpool, self.net.fc = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# One view of a PIL image; unison calls it once per view (SimCLR: 2), with torch's RNG seeded per sample and view.
VIEW = v2.Compose([v2.RandomResizedCrop(32, scale=(0.2, 1.0)), v2.RandomHorizontalFlip(),
                   v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(0.2),
                   v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                   v2.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", help="an ImageFolder (class folders of images)")
    parser.add_argument("--check", action="store_true", help="unison check (2 workers vs 1 process) instead")
    args = parser.parse_args()
    photos = torchvision.datasets.ImageFolder(args.folder)   # items: (PIL image, label)
    pieces = dict(backbone=Backbone(), feature_dim=512, dataset=photos, transform=VIEW)
    if args.check:
        report = unison.check("simclr", world_size=2, steps=2, local_batch=8, **pieces)
        print(report.summary())
    else:
        cfg = TrainConfig(method="simclr", batch_size=64, max_steps=10, out="runs/own_pieces",
                          distributed=DistributedConfig(world_size=2))
        print(unison.train(cfg, **pieces).result_line())
