"""Lightly SSL's side of `unison bench lightly`: each method's Lightly model, transform and optimizer recipe.

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

NNCLR, DCL, DCLW and FastSiam are in that benchmark too (NNCLR: ``NNMemoryBankModule`` of 4096 and NT-Xent; DCL and
DCLW: the SimCLR head with ``DCLLoss`` / ``DCLWLoss``; FastSiam: the SimSiam model on ``FastSiamTransform``'s 4
views, its unscaled 6e-2). TiCo, not in it, follows Lightly's TiCo example (``TiCoProjectionHead`` 1024 / 256, a
momentum copy for the second view, ``TiCoLoss``, ``TiCoTransform``) with its ImageNet benchmark's optimizer and
momentum (``benchmarks/imagenet/resnet50/tico.py``: LARS 0.2 x batch / 256, weight decay 1.5e-6, none on norms
and biases; momentum 0.99 to 1 by a cosine over the steps), since the example's plain SGD without momentum is no
recipe.

MMCR and SMoG follow Lightly's own pipelines: its MMCR example (``examples/pytorch/mmcr.py``: ``MMCRProjectionHead``
512-128, a momentum network at 0.996 -> 1, 8 views of ``MMCRTransform``, ``MMCRLoss``, plain SGD 0.06) and the SMoG
model of its CIFAR-10 benchmark (``SMoGPrototypes``, 300 groups, a ``MemoryBankModule`` of 10,000 and
scikit-learn's ``KMeans`` every 300 steps, SGD 0.01). W-MSE and EMP-SSL have a loss in Lightly but no example: their
sides are Lightly's loss and transform classes put together as the papers' official code does (W-MSE:
``WMSETransform``, a 1024-wide head to 64, ``WMSELoss`` with w_size 128, Adam 3e-3 per 512 images; EMP-SSL: 20
patches of a quarter of the image from ``MultiCropTranform`` with the official colour ops, a 4096-4096-1024 head,
LARS 0.3 per 100 images, and Lightly's ``tcr_loss`` and ``invariance_loss`` with the paper's sign of the coding
rate: Lightly's ``EMPSSLLoss`` adds it, which would minimise it).

VICRegL and DenseCL, which need the backbone's feature map, follow Lightly's examples (`benchmarks.lab.lightly_dense`).

MAE follows Lightly's MAE example (`benchmarks.lab.lightly_models.MAESide`) on a timm ViT of the shared ViT's
architecture, with the example's AdamW 1.5e-4 and ``MAETransform``; its comparison runs on a ViT (the method's recipe
backbone when the bench's is a CNN). So do MSN, PMSN, SimMIM and AIM (`benchmarks.lab.lightly_vit_models`), each with
its example's AdamW 1.5e-4: MSN and PMSN Lightly's MSN example (``MSNTransform``, its focal views at unison's local
crop size; PMSN with ``PMSNLoss``, as Lightly's PMSN page builds it), SimMIM its SimMIM benchmark's pieces (MAE's
transform from 67 %), AIM its AIM example (``AIMTransform``), CAPI its CAPI example (``CAPITransform``, crops from
60 %). Not here: MoCo v3 (Lightly ships no MoCo v3 heads or example), iBOT, DINOv2, I-JEPA, LeJEPA and
distillation, whose Lightly examples are ImageNet ViT recipes with no CIFAR-10 setting to compare against (DINOv2's
loss terms are compared with Lightly's in the unit tests instead), and DINOv3, which Lightly does not have.

Example::

    side = build_lightly_side("byol", backbone, 512, image_size=32, normalize={"mean": [...], "std": [...]})
    loss = side.model.training_loss(views, step, total_steps)   # views: what side.transform made, batched
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .config import LIGHTLY_METHODS
from .lightly_batch_models import EMPSSLSide, MMCRSide, SMoGSide, WMSESide
from .lightly_dense import DenseCLSide, VICRegLSide, map_side
from .lightly_models import (
    BarlowTwinsSide,
    BYOLSide,
    DCLSide,
    DCLWSide,
    DINOSide,
    FastSiamSide,
    MAESide,
    MoCoSide,
    NNCLRSide,
    Side,
    SimCLRSide,
    SimSiamSide,
    SwAVSide,
    TiCoSide,
    VICRegSide,
)
from .lightly_vit_models import AIMSide, CAPISide, MSNSide, PMSNSide, SimMIMSide


@dataclass(frozen=True)
class LightlyRecipe:
    optimizer: str        # "sgd" (momentum 0.9), "lars" (Lightly's, momentum 0.9), "adam" or "adamw"
    lr: float             # per 128 images (Lightly's lr_factor = batch / 128) unless `scale_lr` is False
    weight_decay: float
    scale_lr: bool = True
    momentum: float = 0.9  # SGD's (Lightly's MMCR example: plain SGD)

    def peak_lr(self, batch_size: int) -> float:
        return self.lr * batch_size / 128 if self.scale_lr else self.lr

    def optimizer_for(self, model: nn.Module, peak_lr: float) -> torch.optim.Optimizer:
        """This recipe's optimizer over `model`'s trainable parameters. LARS, as Lightly's benchmarks use it, leaves
        norms and biases out of weight decay (``get_weight_decay_parameters``)."""
        trainable = [q for q in model.parameters() if q.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(trainable, lr=peak_lr, momentum=self.momentum, weight_decay=self.weight_decay)
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
    model: Side             # .backbone, .training_loss(views, step, steps)
    recipe: LightlyRecipe


def _blur(image_size: int, default: Any) -> Any:
    """Lightly's CIFAR-10 benchmark turns blur off at 32 px; above that the transform's own default."""
    return (0.0 if not isinstance(default, tuple) else (0.0,) * len(default)) if image_size <= 32 else default


def _patches(size: int, normalize: dict[str, list[float]]) -> Any:
    """EMP-SSL's 20 patches (its official CIFAR augmentation) from Lightly's multi-crop and transform classes."""
    from lightly import transforms as T
    from lightly.transforms.multi_crop_transform import MultiCropTranform  # sic: Lightly's spelling
    from lightly.transforms.torchvision_v2_compatibility import torchvision_transforms as TV

    colour = TV.Compose([TV.RandomHorizontalFlip(p=0.5), TV.RandomApply([TV.ColorJitter(0.4, 0.4, 0.4, 0.2)], p=0.8),
                         TV.RandomGrayscale(p=0.2), T.GaussianBlur(prob=0.1, sigmas=(0.1, 2.0)),
                         T.RandomSolarization(prob=0.1), TV.ToTensor(), TV.Normalize(**normalize)])
    return MultiCropTranform(crop_sizes=(size,), crop_counts=(20,), crop_min_scales=(0.25,), crop_max_scales=(0.25,),
                             transforms=colour)


def _transform(method: str, size: int, normalize: dict[str, list[float]], grid: int = 0,
               patch: int | None = None) -> Any:
    """Lightly's transform of `method` at `size` px; `grid`: the side of the backbone's feature map (VICRegL's);
    `patch`: the ViT's patch size (MSN's focal views are a multiple of it)."""
    from lightly import transforms as T

    from unison.data.augment import default_local_size

    if method in ("simclr", "nnclr", "dcl", "dclw"):   # Lightly's CIFAR-10 settings (its benchmark's for all four)
        return T.SimCLRTransform(input_size=size, cj_strength=0.5, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "moco":
        return T.MoCoV2Transform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "simsiam":
        return T.SimSiamTransform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "fastsiam":
        return T.FastSiamTransform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "tico":
        return T.TiCoTransform(
            view_1_transform=T.TiCoView1Transform(input_size=size, gaussian_blur=_blur(size, 1.0), normalize=normalize),
            view_2_transform=T.TiCoView2Transform(input_size=size, gaussian_blur=_blur(size, 0.1), normalize=normalize))
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
    if method == "mmcr":   # the example's 8 views, blur off at 32 px as it sets it
        return T.MMCRTransform(k=8, input_size=size, gaussian_blur=_blur(size, 1.0), normalize=normalize)
    if method == "wmse":
        return T.WMSETransform(num_samples=2, input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "smog":   # the benchmark's two crops
        return T.SMoGTransform(crop_sizes=(size, size), crop_counts=(1, 1), cj_strength=0.5,
                               gaussian_blur_probs=_blur(size, (0.5, 0.1)), crop_min_scales=(0.2, 0.2),
                               crop_max_scales=(1.0, 1.0), normalize=normalize)
    if method == "empssl":
        return _patches(size, normalize)
    if method == "vicregl":
        return T.VICRegLTransform(global_crop_size=size, n_local_views=0, global_grid_size=grid,
                                  global_gaussian_blur_prob=_blur(size, 0.5), normalize=normalize)
    if method == "densecl":
        return T.DenseCLTransform(input_size=size, gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method in ("msn", "pmsn"):   # focal views: 3/7 of the image, as unison's (a multiple of the patch: 12 at 32 px)
        return T.MSNTransform(random_size=size, focal_size=default_local_size(size, patch),
                              gaussian_blur=_blur(size, 0.5), normalize=normalize)
    if method == "simmim":   # Lightly's SimMIM benchmark: MAE's transform from 67 %
        return T.MAETransform(input_size=size, min_scale=0.67, normalize=normalize)
    if method == "aim":
        return T.AIMTransform(input_size=size, normalize=normalize)
    if method == "capi":
        return T.CAPITransform(input_size=size, normalize=normalize)
    raise ValueError(f"Lightly has no CIFAR-10 side here for {method!r}; use one of {', '.join(LIGHTLY_METHODS)}")


_SIDES: dict[str, tuple[type[Side], LightlyRecipe]] = {
    "simclr": (SimCLRSide, SGD), "moco": (MoCoSide, SGD),
    "simsiam": (SimSiamSide, LightlyRecipe("sgd", 6e-2, 5e-4, scale_lr=False)),   # "better training stability"
    "barlowtwins": (BarlowTwinsSide, SGD), "byol": (BYOLSide, SGD),
    "swav": (SwAVSide, LightlyRecipe("adam", 1e-3, 1e-6)), "dino": (DINOSide, SGD),
    "vicreg": (VICRegSide, LightlyRecipe("lars", 0.1, 1e-6)),   # its benchmark's LARS 0.2 x batch / 256
    "mae": (MAESide, LightlyRecipe("adamw", 1.5e-4, 0.01, scale_lr=False)),   # the example's AdamW(lr=1.5e-4)
    "nnclr": (NNCLRSide, SGD), "dcl": (DCLSide, SGD), "dclw": (DCLWSide, SGD),
    "tico": (TiCoSide, LightlyRecipe("lars", 0.1, 1.5e-6)),   # its ImageNet benchmark's LARS 0.2 x batch / 256
    "fastsiam": (FastSiamSide, LightlyRecipe("sgd", 6e-2, 5e-4, scale_lr=False)),   # its SimSiam's, unscaled
    "mmcr": (MMCRSide, LightlyRecipe("sgd", 0.06, 0.0, scale_lr=False, momentum=0.0)),   # the example's SGD(lr=0.06)
    "wmse": (WMSESide, LightlyRecipe("adam", 3e-3 / 4, 1e-6)),   # the paper's Adam 3e-3 for 512 images
    "smog": (SMoGSide, LightlyRecipe("sgd", 0.01, 1e-6, scale_lr=False)),   # the benchmark's, at every batch size
    "empssl": (EMPSSLSide, LightlyRecipe("lars", 0.3 * 128 / 100, 1e-4)),   # the official LARS 0.3 for 100 images
    "vicregl": (VICRegLSide, LightlyRecipe("sgd", 6e-2, 0.0)),   # the example's SGD(lr=0.06, momentum=0.9)
    "densecl": (DenseCLSide, SGD),
    **{m: (side, LightlyRecipe("adamw", 1.5e-4, 0.01, scale_lr=False))       # their examples' AdamW(lr=1.5e-4)
       for m, side in (("msn", MSNSide), ("pmsn", PMSNSide), ("simmim", SimMIMSide), ("aim", AIMSide),
                       ("capi", CAPISide))}}


def build_lightly_side(method: str, backbone: nn.Module, dim: int, image_size: int,
                       normalize: dict[str, list[float]]) -> LightlySide:
    """Lightly's model, transform and optimizer recipe for `method` around the shared `backbone` (`dim` wide)."""
    side_cls, recipe = _SIDES[method]
    grid = map_side(backbone, dim, image_size) if method == "vicregl" else 0
    patch = getattr(backbone, "patch_size", None)
    return LightlySide(_transform(method, image_size, normalize, grid, patch), side_cls(backbone, dim), recipe)
