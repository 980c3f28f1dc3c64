"""Lightly SSL's model of each method for `unison bench lightly`: its heads, loss and training step around the
shared backbone, built only from Lightly's modules.

A `Side` wraps the backbone both sides share; ``training_loss(views, step, steps)`` is the body of the training step
of the Lightly benchmark or example the method follows (which one, and the recipe and transform that go with it:
`benchmarks.lab.lightly_methods`). Lightly is imported inside the constructors, so this module imports without it.

Example::

    model = BYOLSide(backbone, 512)
    loss = model.training_loss(views, step, total_steps)   # views: the method's Lightly transform, batched
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.nn as nn


def lightly_momentum_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` without gradients (Lightly's ``deactivate_requires_grad``): a momentum network."""
    from lightly.models.utils import deactivate_requires_grad

    twin = copy.deepcopy(module)
    deactivate_requires_grad(twin)
    return twin


class Side(nn.Module):
    """Lightly's model of one method around the shared backbone; `training_loss` is its example's step body."""

    backbone: nn.Module

    def __init__(self, backbone: nn.Module, dim: int = 0):
        super().__init__()
        self.backbone = backbone

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x).flatten(start_dim=1)

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        raise NotImplementedError


class SimCLRSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import SimCLRProjectionHead

        super().__init__(backbone)
        self.projection_head = SimCLRProjectionHead(dim, 512, 128)
        self.criterion = NTXentLoss(temperature=0.5)   # the existing comparison's, unison's simclr default

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        x0, x1 = views
        return self.criterion(self.projection_head(self.features(x0)), self.projection_head(self.features(x1)))


class MoCoSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead

        super().__init__(backbone)
        self.projection_head = MoCoProjectionHead(dim, 512, 128)
        self.backbone_momentum = lightly_momentum_copy(self.backbone)
        self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        self.criterion = NTXentLoss(temperature=0.1, memory_bank_size=(4096, 128))

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import batch_shuffle, batch_unshuffle, update_momentum

        update_momentum(self.backbone, self.backbone_momentum, 0.99)
        update_momentum(self.projection_head, self.projection_head_momentum, 0.99)

        def pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k, shuffle = batch_shuffle(k)
            query = self.projection_head(self.features(q))
            key = self.projection_head_momentum(self.backbone_momentum(k).flatten(start_dim=1))
            return query, batch_unshuffle(key, shuffle).detach()

        x0, x1 = views   # symmetric, as Lightly's benchmark
        return 0.5 * (self.criterion(*pair(x0, x1)) + self.criterion(*pair(x1, x0)))


class SimSiamSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules.heads import ProjectionHead, SimSiamPredictionHead

        super().__init__(backbone)
        self.prediction_head = SimSiamPredictionHead(2048, 512, 2048)
        self.projection_head = ProjectionHead([(dim, 2048, nn.BatchNorm1d(2048), nn.ReLU(inplace=True)),
                                               (2048, 2048, nn.BatchNorm1d(2048), None)])   # 2 layers for CIFAR
        self.criterion = NegativeCosineSimilarity()

    def _zp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.projection_head(self.features(x))
        return z.detach(), self.prediction_head(z)

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        (z0, p0), (z1, p1) = self._zp(views[0]), self._zp(views[1])
        return 0.5 * (self.criterion(z0, p1) + self.criterion(z1, p0))


class BarlowTwinsSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import BarlowTwinsLoss
        from lightly.models.modules.heads import ProjectionHead

        super().__init__(backbone)
        self.projection_head = ProjectionHead([(dim, 2048, nn.BatchNorm1d(2048), nn.ReLU(inplace=True)),
                                               (2048, 2048, None, None)])
        self.criterion = BarlowTwinsLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        return self.criterion(*(self.projection_head(self.features(v)) for v in views))


class BYOLSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead

        super().__init__(backbone)
        self.projection_head = BYOLProjectionHead(dim, 1024, 256)
        self.prediction_head = BYOLPredictionHead(256, 1024, 256)
        self.backbone_momentum = lightly_momentum_copy(self.backbone)
        self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        self.criterion = NegativeCosineSimilarity()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m=0.99)
        update_momentum(self.projection_head, self.projection_head_momentum, m=0.99)
        p0, p1 = (self.prediction_head(self.projection_head(self.features(v))) for v in views)
        z0, z1 = (self.projection_head_momentum(self.backbone_momentum(v).flatten(start_dim=1)).detach()
                  for v in views)
        return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))


class SwAVSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import SwaVLoss
        from lightly.models.modules import SwaVProjectionHead, SwaVPrototypes

        super().__init__(backbone)
        self.projection_head = SwaVProjectionHead(dim, 512, 128)
        self.prototypes = SwaVPrototypes(128, 512)   # 512 prototypes
        self.criterion = SwaVLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        self.prototypes.normalize()
        out = [self.prototypes(nn.functional.normalize(self.projection_head(self.features(v)), dim=1, p=2))
               for v in views]
        return self.criterion(out[:2], out[2:])


class VICRegSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import VICRegLoss
        from lightly.models.modules.heads import VICRegProjectionHead

        super().__init__(backbone)
        self.projection_head = VICRegProjectionHead(input_dim=dim, hidden_dim=2048, output_dim=2048, num_layers=2)
        self.criterion = VICRegLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        return self.criterion(*(self.projection_head(self.features(v)) for v in views))


class DINOSide(Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import DINOLoss
        from lightly.models.utils import deactivate_requires_grad

        super().__init__(backbone)
        self.head = self._head(dim)
        self.teacher_backbone = lightly_momentum_copy(self.backbone)
        self.teacher_head = self._head(dim)   # built anew, as Lightly's (its weight-normed layer cannot be copied)
        deactivate_requires_grad(self.teacher_head)
        self.criterion = DINOLoss(output_dim=2048)

    @staticmethod
    def _head(dim: int) -> nn.Module:
        from lightly.models.modules.heads import DINOProjectionHead, ProjectionHead

        head = DINOProjectionHead(dim, 2048, 256, 2048, batch_norm=True)
        head.layers = ProjectionHead([(dim, 2048, nn.BatchNorm1d(2048), nn.GELU()),
                                      (2048, 256, None, None)]).layers   # 2 layers for CIFAR, as the benchmark
        return head

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.teacher_backbone, m=0.99)
        update_momentum(self.head, self.teacher_head, m=0.99)
        teacher = [self.teacher_head(self.teacher_backbone(v).flatten(start_dim=1)) for v in views[:2]]
        student = [self.head(self.features(v)) for v in views]
        return self.criterion(teacher, student, epoch=0)   # warm-up of the teacher temperature: 30 epochs, past


class NNCLRSide(Side):
    """Lightly's CIFAR-10 NNCLR benchmark: a 2-layer projector with batch norm after both layers, its NNCLR
    prediction head, a 4096-entry `NNMemoryBankModule` (the second view's projections enqueued) and NT-Xent."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import NNCLRPredictionHead, NNMemoryBankModule
        from lightly.models.modules.heads import ProjectionHead

        super().__init__(backbone)
        self.projection_head = ProjectionHead([(dim, 2048, nn.BatchNorm1d(2048), nn.ReLU(inplace=True)),
                                               (2048, 256, nn.BatchNorm1d(256), None)])
        self.prediction_head = NNCLRPredictionHead(256, 4096, 256)
        self.memory_bank = NNMemoryBankModule(size=(4096, 256))
        self.criterion = NTXentLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        (z0, p0), (z1, p1) = self._zp(views[0]), self._zp(views[1])
        z0 = self.memory_bank(z0, update=False)
        z1 = self.memory_bank(z1, update=True)
        return 0.5 * (self.criterion(z0, p1) + self.criterion(z1, p0))

    def _zp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.projection_head(self.features(x))
        return z.detach(), self.prediction_head(z)


class DCLSide(SimCLRSide):
    """Lightly's CIFAR-10 DCL benchmark: its SimCLR model with ``DCLLoss``."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import DCLLoss

        super().__init__(backbone, dim)
        self.criterion = DCLLoss()


class DCLWSide(SimCLRSide):
    """Lightly's CIFAR-10 DCLW benchmark: its SimCLR model with ``DCLWLoss``."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import DCLWLoss

        super().__init__(backbone, dim)
        self.criterion = DCLWLoss()


class TiCoSide(Side):
    """Lightly's TiCo example and ImageNet benchmark: ``TiCoProjectionHead`` 1024 wide and 256 out, a momentum
    copy of backbone and head for the second view (momentum 0.99, cosine to 1 over the steps), ``TiCoLoss``."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss.tico_loss import TiCoLoss
        from lightly.models.modules.heads import TiCoProjectionHead

        super().__init__(backbone)
        self.projection_head = TiCoProjectionHead(dim, 1024, 256)
        self.backbone_momentum = lightly_momentum_copy(self.backbone)
        self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        self.criterion = TiCoLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum
        from lightly.utils.scheduler import cosine_schedule

        momentum = cosine_schedule(step, steps, 0.99, 1.0)
        update_momentum(self.backbone, self.backbone_momentum, m=momentum)
        update_momentum(self.projection_head, self.projection_head_momentum, m=momentum)
        x0, x1 = views
        z0 = self.projection_head(self.features(x0))
        with torch.no_grad():
            z1 = self.projection_head_momentum(self.backbone_momentum(x1).flatten(start_dim=1))
        return self.criterion(z0, z1)


class FastSiamSide(SimSiamSide):
    """Lightly's CIFAR-10 FastSiam benchmark: its SimSiam model on 4 views, each prediction against the mean of
    the other three projections."""

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        features = [self._zp(v) for v in views]
        zs = torch.stack([z for z, _ in features])
        ps = torch.stack([p for _, p in features])
        loss = ps.new_zeros(())
        for i in range(len(views)):
            mask = torch.arange(len(views), device=ps.device) != i
            loss = loss + self.criterion(ps[i], torch.mean(zs[mask], dim=0)) / len(views)
        return loss


class MAESide(Side):
    """Lightly's MAE example: `MaskedVisionTransformerTIMM` around a timm ViT of the shared backbone's architecture
    (unison's ViT is timm's parts with token access, not timm's class, which Lightly's wrapper needs), an
    `MAEDecoderTIMM` 512 wide and 1 block deep, 75 % of the patches masked, MSE on the masked pixels."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules import MAEDecoderTIMM, MaskedVisionTransformerTIMM

        vit = timm_vit_like(backbone, "MAE")
        super().__init__(MaskedVisionTransformerTIMM(vit=vit))
        self.mask_ratio = 0.75
        self.patch_size = int(vit.patch_embed.patch_size[0])
        self.decoder = MAEDecoderTIMM(num_patches=vit.patch_embed.num_patches, patch_size=self.patch_size,
                                      embed_dim=vit.embed_dim, decoder_embed_dim=512, decoder_depth=1,
                                      decoder_num_heads=16, mlp_ratio=4.0, proj_drop_rate=0.0, attn_drop_rate=0.0)
        self.criterion = nn.MSELoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models import utils

        images, encoder = views[0], cast(Any, self.backbone)   # Lightly's MaskedVisionTransformerTIMM
        length = int(encoder.sequence_length)
        idx_keep, idx_mask = utils.random_token_mask(size=(images.shape[0], length), mask_ratio=self.mask_ratio,
                                                     device=images.device)
        encoded = encoder.encode(images=images, idx_keep=idx_keep)
        masked = utils.repeat_token(self.decoder.mask_token, (images.shape[0], length))
        masked = utils.set_at_index(masked, idx_keep, self.decoder.embed(encoded).type_as(masked))
        pred = self.decoder.predict(utils.get_at_index(self.decoder.decode(masked), idx_mask))
        target = utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1)
        return self.criterion(pred, target)


def vit_spec(backbone: nn.Module, method: str) -> dict[str, Any]:
    """The architecture of unison's ViT `backbone` (image and patch size, width, depth, heads) as timm's arguments."""
    from unison.models.vit import ViT

    if not isinstance(backbone, ViT):
        raise ValueError(f"Lightly's {method} side needs a unison ViT backbone (vit_*), got {type(backbone).__name__}")
    return {"img_size": backbone.grid * backbone.patch_size, "patch_size": backbone.patch_size,
            "embed_dim": backbone.embed_dim, "depth": len(backbone.blocks),
            "num_heads": int(cast(Any, backbone.blocks[0]).attn.num_heads)}


def timm_vit_like(backbone: nn.Module, method: str, **kwargs: Any) -> Any:
    """A timm ``VisionTransformer`` of the architecture of unison's ViT `backbone` (`vit_spec`): the same backbone in
    the class Lightly's ViT wrappers take (`kwargs`: timm's other arguments, e.g. ``dynamic_img_size``)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**vit_spec(backbone, method), num_classes=0, **kwargs)
