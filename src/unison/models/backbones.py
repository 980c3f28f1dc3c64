"""Encoders: a small CNN for CPU runs, CIFAR-variant ResNets from torchvision, timm models if installed.

`build_backbone(name)` returns ``(module, feature_dim)``; the module maps images
[B, 3, H, W] to features [B, feature_dim] (no classifier).

* ``small_cnn``: 4 conv-BN-ReLU blocks and global average pooling; trains in seconds on CPU.
* ``resnet18`` / ``resnet50``: torchvision's models with the CIFAR stem (3x3 conv, stride 1,
  no max-pool), as in Lightly's and solo-learn's CIFAR benchmarks; ``fc`` is removed, so
  `unison export` writes a state dict that loads into ``torchvision.models.resnet18`` with
  the same stem (``strict=False`` for the missing ``fc``).
* ``vit_nano|tiny|small|base`` with 16 px patches, ``..._p4`` (4 px patches, 32 px images) and
  ``..._p2`` (2 px patches, 16 px images): Vision Transformers with token-level access for
  the masked-image methods (`unison.models.vit`).
* ``timm:<name>``: any timm model with ``num_classes=0``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .vit import VIT_BACKBONES, build_vit


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, in_channels: int = 3):
        super().__init__()
        w = width

        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(in_channels, w, 1), *block(w, 2 * w, 2), *block(2 * w, 4 * w, 2),
                                      *block(4 * w, 4 * w, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = 4 * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def cifar_resnet(name: str) -> tuple[nn.Module, int]:
    import torchvision

    model = getattr(torchvision.models, name)(weights=None)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, dim


def build_backbone(name: str) -> tuple[nn.Module, int]:
    if name == "small_cnn":
        m = SmallCNN()
        return m, m.feature_dim
    if name in ("resnet18", "resnet50"):
        return cifar_resnet(name)
    if name in VIT_BACKBONES:
        vit = build_vit(name)
        return vit, vit.feature_dim
    if name.startswith("timm:"):
        try:
            import timm
        except ImportError:
            raise ValueError(f"backbone {name!r} needs timm: pip install timm") from None
        m = timm.create_model(name[5:], pretrained=False, num_classes=0)
        return m, m.num_features
    raise ValueError(f"unknown backbone {name!r}; use one of {', '.join(BACKBONES)} or timm:<model>")


BACKBONES = ("small_cnn", "resnet18", "resnet50", *VIT_BACKBONES)
