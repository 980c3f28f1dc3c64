"""The augmentation presets of `unison.data.augment.ViewAugmenter`: named parameter sets, plain data.

Apart from the code that applies them, so a preset can be read, compared and listed (``unison
train --help``, `unison.training.resolve`) without the augmentation's tensors. A method names its
preset (`unison.methods`); any parameter can be overridden by keyword when building the augmenter.

Preset parameters (`PRESETS`, any can be overridden by keyword)
---------------------------------------------------------------
n_global, n_local        number of global views (``image_size``) and local views (``local_size``)
local_size               local view size; None: ``max(8, round(image_size * 3 / 7))`` (96 for 224, 14 for 32), a
                         multiple of the backbone's patch size for ViTs (`unison.data.augment.default_local_size`)
crop_scale               area fraction range of global crops
local_crop_scale         area fraction range of local crops
crop_ratio               aspect-ratio range (sampled log-uniformly)
flip_p                   horizontal flip probability
rotation                 max rotation in degrees (uniform in [-r, r]); 0 = none
jitter_p                 probability of the colour-jitter block
brightness, contrast,    jitter strengths: factors uniform in [1-s, 1+s]
saturation, hue          (hue: shift uniform in [-hue, hue] turns, hue <= 0.5)
grayscale_p              random-grayscale probability
blur_p                   blur probability: a number, or one number per view
blur_sigma               (min, max) sigma in pixels of the view
blur_off_at_or_below     blur is off for all views when image_size <= this (0: never off)
solarize_p               solarisation probability: a number, or one per view
solarize_threshold       in [0, 1] units
noise_std                std of additive gaussian noise (0: none)

Example::

    PRESETS["byol"]["solarize_p"]      # (0.0, 0.2): one probability per view
"""

from __future__ import annotations

__all__ = ["PRESETS"]

_COMMON = dict(
    n_global=2,
    n_local=0,
    local_size=None,
    crop_scale=(0.08, 1.0),
    local_crop_scale=(0.05, 0.14),
    crop_ratio=(3 / 4, 4 / 3),
    flip_p=0.5,
    rotation=0.0,
    jitter_p=0.8,
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    hue=0.1,
    grayscale_p=0.2,
    blur_p=0.5,
    blur_sigma=(0.1, 2.0),
    blur_off_at_or_below=32,
    solarize_p=0.0,
    solarize_threshold=0.5,
    noise_std=0.0,
)

PRESETS: dict[str, dict] = {
    # SimCLR (Chen et al., 2020), as in solo-learn / lightly CIFAR configs.
    "simclr": dict(_COMMON),
    # MoCo v2 (Chen et al., 2020, "Improved Baselines") and SimSiam (Chen & He, 2021): SimCLR's colour ops, crops
    # from 20 % of the image (their code's RandomResizedCrop(scale=(0.2, 1.0)); Lightly's MoCoV2Transform and
    # SimSiamTransform too): SimCLR's 8 % is not what these methods train with.
    "mocov2": {**_COMMON, "crop_scale": (0.2, 1.0)},
    # BYOL (Grill et al., 2020): asymmetric blur / solarisation between the two views.
    "byol": {**_COMMON, "saturation": 0.2, "blur_p": (1.0, 0.1), "solarize_p": (0.0, 0.2)},
    # SwAV / DINO multi-crop with SimCLR colour ops: 2 global + 4 local crops.
    "multicrop": {**_COMMON, "n_local": 4, "crop_scale": (0.14, 1.0), "local_crop_scale": (0.05, 0.14)},
    # Embedded 16x16 digits: no flip (digits are not mirror symmetric), no hue/saturation
    # (grey images), mild crops, small rotations, brightness/contrast jitter.
    "digits": {
        **_COMMON,
        "crop_scale": (0.4, 1.0),
        "flip_p": 0.0,
        "rotation": 15.0,
        "saturation": 0.0,
        "hue": 0.0,
        "grayscale_p": 0.0,
        "blur_p": 0.0,
        "noise_std": 0.0,  # no noise: it does not train better on the digits and costs more than the rest on a CPU
    },
}
# FastSiam (Pototzky et al., 2022): SimSiam's views (mocov2's) x 4, as Lightly's FastSiamTransform; on the digits,
# the digits' views x 4.
PRESETS["fastsiam"] = {**PRESETS["mocov2"], "n_global": 4}
PRESETS["digits_fastsiam"] = {**PRESETS["digits"], "n_global": 4}
# Multi-crop (SwAV / DINO) on the digits: the digits' colour ops, 2 global + 4 local 8x8 crops.
PRESETS["digits_multicrop"] = {**PRESETS["digits"], "n_local": 4, "local_crop_scale": (0.2, 0.5)}
# MAE / I-JEPA (He et al., 2022; Assran et al., 2023): ONE view, random resized crop and flip, no colour ops
# (masking is the pretext task). On the digits: their crop and rotation, no flip.
PRESETS["crop"] = {**_COMMON, "n_global": 1, "crop_scale": (0.2, 1.0), "jitter_p": 0.0, "grayscale_p": 0.0,
                   "blur_p": 0.0}
PRESETS["digits_crop"] = {**PRESETS["digits"], "n_global": 1, "jitter_p": 0.0}
# Distillation (LightlyTrain's DistillationV3Transform): ONE view, crops from 0.14, flip, colour jitter at strength
# 0.5 (brightness/contrast 0.4, saturation 0.2, hue 0.1), grey 0.2; their blur (sigma <= 0.1 px) is left out.
# On the digits: digits_crop.
PRESETS["distill"] = {**_COMMON, "n_global": 1, "crop_scale": (0.14, 1.0), "saturation": 0.2, "blur_p": 0.0}
# W-MSE (Ermolov et al., 2021), its official CIFAR / STL-10 / Tiny ImageNet settings (``cfg.py``): SimCLR's colour
# jitter, grey 0.1, crops from 20 % of the image, no blur at any size.
PRESETS["wmse"] = {**_COMMON, "crop_scale": (0.2, 1.0), "grayscale_p": 0.1, "blur_p": 0.0}
# SMoG (Pang et al., 2022): BYOL's asymmetric views as Lightly's SMoGTransform makes them (the paper has no code):
# jitter on every view at strength 0.5 (brightness/contrast 0.4, saturation 0.2, hue 0.1), grey 0.2, crops from
# 20 %, blur 0.5 / 0.1 and solarisation 0 / 0.2 on the two views (blur off at 32 px and below, as Lightly's CIFAR-10
# benchmark runs it).
PRESETS["smog"] = {**_COMMON, "crop_scale": (0.2, 1.0), "jitter_p": 1.0, "saturation": 0.2, "blur_p": (0.5, 0.1),
                   "solarize_p": (0.0, 0.2)}
# EMP-SSL (Tong et al., 2023), its official CIFAR augmentation (``dataset/aug.py``): many fixed-size patches per image,
# each a square of a quarter of the image's area (16 px of a 32 px image) resized to the image size, flip, jitter
# 0.8 (hue 0.2), grey 0.2, blur 0.1 (at 32 px too), solarisation 0.1. Its number of patches is the method's
# parameter (`unison.methods.empssl`, 20 at CIFAR scale); on the digits: their colour ops and rotation, patches as
# those of CIFAR.
PRESETS["patches"] = {**_COMMON, "n_global": 20, "crop_scale": (0.25, 0.25), "crop_ratio": (1.0, 1.0), "hue": 0.2,
                      "blur_p": 0.1, "blur_off_at_or_below": 0, "solarize_p": 0.1}
PRESETS["digits_patches"] = {**PRESETS["digits"], "n_global": 20, "crop_scale": (0.25, 0.25), "crop_ratio": (1.0, 1.0)}
# Fine-tuning and the standard linear protocol (`unison.eval.recipe`; SimCLR's appendix B.5 and its linear
# evaluation): ONE view, random resized crop from 8 % and a flip, no colour ops. On the digits: digits_crop.
PRESETS["classify"] = {**_COMMON, "n_global": 1, "jitter_p": 0.0, "grayscale_p": 0.0, "blur_p": 0.0}
# MSN (Assran et al., 2022), its official ``make_transforms``: two random crops from 30 % of the image (the target and
# the anchor view) and 10 focal crops of 5-30 % at 3/7 of the image size (96 px at 224), SimCLR's colour jitter at
# strength 0.5 (brightness/contrast/saturation 0.4, hue 0.1, p 0.8), grey 0.2, blur 0.5. On the digits:
# digits_multicrop.
PRESETS["msn"] = {**_COMMON, "n_local": 10, "crop_scale": (0.3, 1.0), "local_crop_scale": (0.05, 0.3)}
# SimMIM (Xie et al., 2022), its official ``SimMIMTransform``: ONE view, random resized crops from 67 % of the image,
# flip, no colour ops. AIM (El-Nouby et al., 2024), as Lightly's ``AIMTransform``: the same from 40 %. On the digits:
# digits_crop.
PRESETS["simmim"] = {**PRESETS["crop"], "crop_scale": (0.67, 1.0)}
PRESETS["aim"] = {**PRESETS["crop"], "crop_scale": (0.4, 1.0)}
# CAPI (Darcet et al., 2025), its official pretraining transform: ONE view, random resized crops from 60 % of the
# image, flip, no colour ops. On the digits: digits_crop.
PRESETS["capi"] = {**PRESETS["crop"], "crop_scale": (0.6, 1.0)}

# DINOv2 / DINOv3 (Oquab et al., 2024), their official ``DataAugmentationDINO`` settings: 2 global crops from 32 % of
# the image and 8 local crops of 5-32 % at 3/7 of its size (96 px at 224), colour jitter 0.8 (brightness/contrast
# 0.4, saturation 0.2, hue 0.1), grey 0.2. Their blur (1.0 / 0.1 on the global crops, 0.5 on the local ones) and
# solarisation (0.2, second global crop) are per view, which --local-crops would have to follow: blur 0.5 on every
# view and no solarisation instead. On the digits: digits_multicrop.
PRESETS["dinov2"] = {**_COMMON, "n_local": 8, "crop_scale": (0.32, 1.0), "local_crop_scale": (0.05, 0.32),
                     "saturation": 0.2}
