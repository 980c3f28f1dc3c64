"""Lightly SSL's side of `unison bench lightly`, one module per method, built only from Lightly's own pieces.

Each side is what Lightly documents for CIFAR-10: its benchmark module for the method
(``docs/source/getting_started/benchmarks/cifar10_benchmark.py`` of lightly-ai/lightly: heads and their widths,
loss settings, momentum 0.99, optimizer SGD 6e-2 x batch / 128 with momentum 0.9 and weight decay 5e-4, SwAV's
Adam 1e-3 x batch / 128, SimSiam's unscaled 6e-2), with the transform classes of Lightly's examples for that
method (``MoCoV2Transform``, ``SimSiamTransform``, ``BYOLTransform``, ``SwaVTransform``, ``VICRegTransform``,
``DINOTransform``; blur off at 32 px and below, SwAV two 32 px crops and DINO no local views, as the benchmark
sets them). VICReg, not in that benchmark, follows Lightly's VICReg example (2-layer 2048-wide head,
``VICRegLoss``) with the optimizer of Lightly's ImageNet VICReg benchmark (``benchmarks/imagenet/resnet50/
vicreg.py``: LARS 0.2 x batch / 256, weight decay 1e-6, none on norms and biases); with the CIFAR-10
benchmark's SGD its loss diverged to NaN. The head's input width is the shared backbone's (512 for
ResNet-18, as in Lightly's modules; 128 for the small CNN). The cosine schedule is unison's, a pure function of
the step, on both sides.

MAE follows Lightly's MAE example (`MAESide`) on a timm ViT of the shared ViT's architecture, with the
example's AdamW 1.5e-4 and ``MAETransform``; its comparison runs on a ViT (the method's recipe backbone when the
bench's is a CNN). Not here: MoCo v3 (Lightly ships no MoCo v3 heads or example), and iBOT, I-JEPA, LeJEPA and
distillation, whose Lightly examples are ImageNet ViT recipes with no CIFAR-10 setting to compare against.

Example::

    side = build_lightly_side("byol", backbone, 512, image_size=32, normalize={"mean": [...], "std": [...]})
    loss = side.model.training_loss(views, step, total_steps)   # views: what side.transform made, batched
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn

from .config import LIGHTLY_METHODS


@dataclass(frozen=True)
class LightlyRecipe:
    optimizer: str        # "sgd" (momentum 0.9), "lars" (Lightly's, momentum 0.9), "adam" or "adamw"
    lr: float             # per 128 images (Lightly's lr_factor = batch / 128) unless `scale_lr` is False
    weight_decay: float
    scale_lr: bool = True

    def peak_lr(self, batch_size: int) -> float:
        return self.lr * batch_size / 128 if self.scale_lr else self.lr

    def optimizer_for(self, model: nn.Module, peak_lr: float) -> torch.optim.Optimizer:
        """This recipe's optimizer over `model`'s trainable parameters. LARS, as Lightly's benchmarks use it, leaves
        norms and biases out of weight decay (``get_weight_decay_parameters``)."""
        trainable = [q for q in model.parameters() if q.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(trainable, lr=peak_lr, momentum=0.9, weight_decay=self.weight_decay)
        if self.optimizer == "lars":
            from lightly.models.utils import get_weight_decay_parameters
            from lightly.utils.lars import LARS

            decay, no_decay = get_weight_decay_parameters([model])
            groups = [{"params": [q for q in decay if q.requires_grad]},
                      {"params": [q for q in no_decay if q.requires_grad], "weight_decay": 0.0}]
            return LARS(groups, lr=peak_lr, momentum=0.9, weight_decay=self.weight_decay)
        return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.optimizer](
            trainable, lr=peak_lr, weight_decay=self.weight_decay)


SGD = LightlyRecipe("sgd", 6e-2, 5e-4)


@dataclass
class LightlySide:
    transform: Any          # a Lightly transform: PIL image -> list of view tensors
    model: _Side            # .backbone, .training_loss(views, step, steps)
    recipe: LightlyRecipe


def _blur(image_size: int, default: Any) -> Any:
    """Lightly's CIFAR-10 benchmark turns blur off at 32 px; above that the transform's own default."""
    return (0.0 if not isinstance(default, tuple) else (0.0,) * len(default)) if image_size <= 32 else default


def _momentum_copy(module: nn.Module) -> nn.Module:
    from lightly.models.utils import deactivate_requires_grad

    twin = copy.deepcopy(module)
    deactivate_requires_grad(twin)
    return twin


class _Side(nn.Module):
    """Lightly's model of one method around the shared backbone; `training_loss` is its example's step body."""

    backbone: nn.Module

    def __init__(self, backbone: nn.Module, dim: int = 0):
        super().__init__()
        self.backbone = backbone

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x).flatten(start_dim=1)

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        raise NotImplementedError


class SimCLRSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import SimCLRProjectionHead

        super().__init__(backbone)
        self.projection_head = SimCLRProjectionHead(dim, 512, 128)
        self.criterion = NTXentLoss(temperature=0.5)   # the existing comparison's, unison's simclr default

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        x0, x1 = views
        return self.criterion(self.projection_head(self.features(x0)), self.projection_head(self.features(x1)))


class MoCoSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead

        super().__init__(backbone)
        self.projection_head = MoCoProjectionHead(dim, 512, 128)
        self.backbone_momentum = _momentum_copy(self.backbone)
        self.projection_head_momentum = _momentum_copy(self.projection_head)
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


class SimSiamSide(_Side):
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


class BarlowTwinsSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import BarlowTwinsLoss
        from lightly.models.modules.heads import ProjectionHead

        super().__init__(backbone)
        self.projection_head = ProjectionHead([(dim, 2048, nn.BatchNorm1d(2048), nn.ReLU(inplace=True)),
                                               (2048, 2048, None, None)])
        self.criterion = BarlowTwinsLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        return self.criterion(*(self.projection_head(self.features(v)) for v in views))


class BYOLSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead

        super().__init__(backbone)
        self.projection_head = BYOLProjectionHead(dim, 1024, 256)
        self.prediction_head = BYOLPredictionHead(256, 1024, 256)
        self.backbone_momentum = _momentum_copy(self.backbone)
        self.projection_head_momentum = _momentum_copy(self.projection_head)
        self.criterion = NegativeCosineSimilarity()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m=0.99)
        update_momentum(self.projection_head, self.projection_head_momentum, m=0.99)
        p0, p1 = (self.prediction_head(self.projection_head(self.features(v))) for v in views)
        z0, z1 = (self.projection_head_momentum(self.backbone_momentum(v).flatten(start_dim=1)).detach()
                  for v in views)
        return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))


class SwAVSide(_Side):
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


class VICRegSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import VICRegLoss
        from lightly.models.modules.heads import VICRegProjectionHead

        super().__init__(backbone)
        self.projection_head = VICRegProjectionHead(input_dim=dim, hidden_dim=2048, output_dim=2048, num_layers=2)
        self.criterion = VICRegLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        return self.criterion(*(self.projection_head(self.features(v)) for v in views))


class DINOSide(_Side):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import DINOLoss
        from lightly.models.utils import deactivate_requires_grad

        super().__init__(backbone)
        self.head = self._head(dim)
        self.teacher_backbone = _momentum_copy(self.backbone)
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


class MAESide(_Side):
    """Lightly's MAE example: `MaskedVisionTransformerTIMM` around a timm ViT of the shared backbone's architecture
    (unison's ViT is timm's parts with token access, not timm's class, which Lightly's wrapper needs), an
    `MAEDecoderTIMM` 512 wide and 1 block deep, 75 % of the patches masked, MSE on the masked pixels."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules import MAEDecoderTIMM, MaskedVisionTransformerTIMM

        vit = timm_vit_like(backbone)
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


def timm_vit_like(backbone: nn.Module) -> Any:
    """A timm ``VisionTransformer`` of the architecture of unison's ViT `backbone` (image and patch size, width,
    depth, heads): the same backbone in the class Lightly's ViT wrappers take."""
    from timm.models.vision_transformer import VisionTransformer

    from unison.models.vit import ViT

    if not isinstance(backbone, ViT):
        raise ValueError(f"Lightly's MAE side needs a unison ViT backbone (vit_*), got {type(backbone).__name__}")
    heads = int(cast(Any, backbone.blocks[0]).attn.num_heads)
    return VisionTransformer(img_size=backbone.grid * backbone.patch_size, patch_size=backbone.patch_size,
                             embed_dim=backbone.embed_dim, depth=len(backbone.blocks), num_heads=heads,
                             num_classes=0)


def _transform(method: str, size: int, normalize: dict[str, list[float]]) -> Any:
    from lightly import transforms as T

    if method == "simclr":   # the existing comparison's, Lightly's CIFAR-10 settings
        return T.SimCLRTransform(input_size=size, cj_strength=0.5, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "moco":
        return T.MoCoV2Transform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "simsiam":
        return T.SimSiamTransform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method in ("byol", "barlowtwins"):   # Lightly's Barlow Twins example uses BYOL's views
        return T.BYOLTransform(
            view_1_transform=T.BYOLView1Transform(input_size=size, gaussian_blur=_blur(size, 1.0), normalize=normalize),
            view_2_transform=T.BYOLView2Transform(input_size=size, gaussian_blur=_blur(size, 0.1), normalize=normalize))
    if method == "swav":
        crops: dict[str, Any] = {"crop_sizes": (size,), "crop_counts": (2,), "crop_min_scales": (0.14,),
                                 "crop_max_scales": (1.0,)}   # two 32 px crops, as the benchmark (stubs: two sizes)
        return T.SwaVTransform(**crops, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "vicreg":
        return T.VICRegTransform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "dino":
        return T.DINOTransform(global_crop_size=size, n_local_views=0, gaussian_blur=_blur(size, (1.0, 0.1, 0.5)),
                               normalize=normalize)
    if method == "mae":
        return T.MAETransform(input_size=size, normalize=normalize)
    raise ValueError(f"Lightly has no CIFAR-10 side here for {method!r}; use one of {', '.join(LIGHTLY_METHODS)}")


_SIDES: dict[str, tuple[type[_Side], LightlyRecipe]] = {
    "simclr": (SimCLRSide, SGD), "moco": (MoCoSide, SGD),
    "simsiam": (SimSiamSide, LightlyRecipe("sgd", 6e-2, 5e-4, scale_lr=False)),   # "better training stability"
    "barlowtwins": (BarlowTwinsSide, SGD), "byol": (BYOLSide, SGD),
    "swav": (SwAVSide, LightlyRecipe("adam", 1e-3, 1e-6)), "dino": (DINOSide, SGD),
    "vicreg": (VICRegSide, LightlyRecipe("lars", 0.1, 1e-6)),   # its benchmark's LARS 0.2 x batch / 256
    "mae": (MAESide, LightlyRecipe("adamw", 1.5e-4, 0.01, scale_lr=False))}   # the example's AdamW(lr=1.5e-4)


def build_lightly_side(method: str, backbone: nn.Module, dim: int, image_size: int,
                       normalize: dict[str, list[float]]) -> LightlySide:
    """Lightly's model, transform and optimizer recipe for `method` around the shared `backbone` (`dim` wide)."""
    side_cls, recipe = _SIDES[method]
    return LightlySide(_transform(method, image_size, normalize), side_cls(backbone, dim), recipe)
