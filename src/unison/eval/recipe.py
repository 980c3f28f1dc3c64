"""The recipes of the two evaluations that train on the images: end-to-end fine-tuning and the standard linear
protocol, each as its papers define it, every value an option with a default.

* **Fine-tuning, ViT** (MAE, He et al. 2022, appendix A.1, the ViT-B column): AdamW (betas 0.9, 0.999), base
  learning rate 5e-4 per 256 images (scaled linearly with the global batch), weight decay 0.05, layer-wise
  learning-rate decay 0.65 (`unison.optim.groups.layer_scales`), 5 warm-up epochs of 100 (the first 5 % of
  the epochs, when another number of epochs is given) then a cosine to 0, drop path 0.1
  (`unison.eval.classifier.KeyedDropPath`), label smoothing 0.1, the head initialised with std 2e-5. MAE's
  RandAugment and random erasing are replaced by unison's own augmentation (the ``classify`` preset: random
  resized crop from 8 % and a flip, drawn per (seed, epoch, index)); its mixup 0.8 and cutmix 1.0 are options
  here (`unison.eval.mix`), off by default.
* **Fine-tuning, CNN** (SimCLR, Chen et al. 2020, appendix B.5, the semi-supervised fine-tuning): SGD with
  Nesterov momentum 0.9, base learning rate 0.05 per 256 images, no weight decay, no warm-up, a cosine to 0,
  60 epochs (their 1 % setting), crop and flip only.
* **Standard linear protocol** (SimCLR's and MoCo's linear evaluation, with MAE's parameter-free batch norm in
  front of the classifier): the backbone frozen (eval mode: running statistics, no dropout), a linear
  classifier trained on augmented views (crop and flip) of the training images by SGD with Nesterov
  momentum 0.9, base learning rate 0.1 per 256 images, no weight decay, 100 epochs, a cosine to 0; top-1 and
  top-5 on the whole held-out set.

`resolve_recipe(protocol, family, given)` takes the protocol's defaults for the backbone's family (``vit``:
unison's ViTs and timm models with a patch embedding; ``cnn``: the rest) and the values the user gave (None:
not given), checks them (one line each) and returns the `ClassifierRecipe` a run uses and records.

Example::

    recipe = resolve_recipe("fine-tune", "vit", {"epochs": 10, "batch_size": 128})
    recipe.lr            # 2.5e-4: 5e-4 x 128 / 256
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from unison.errors import ConfigError

__all__ = ["FAMILIES", "OPTIMIZERS", "PROTOCOLS", "ClassifierRecipe", "resolve_recipe"]

PROTOCOLS = ("fine-tune", "linear")
FAMILIES = ("vit", "cnn")
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class ClassifierRecipe:
    """Everything that decides what a fine-tuning or standard linear evaluation computes."""

    protocol: str                  # "fine-tune" (every parameter trains) or "linear" (the backbone frozen)
    family: str                    # "vit" or "cnn": whose paper's defaults
    epochs: int
    batch_size: int                # the global batch
    optimizer: str                 # "sgd" (Nesterov momentum) or "adamw"
    base_lr: float                 # per 256 images
    weight_decay: float
    momentum: float                # SGD's; AdamW's beta1
    layer_decay: float | None      # None: every block the same rate
    warmup_epochs: float
    drop_path: float               # the last block's rate; block i of n: rate * i / (n - 1), as timm
    label_smoothing: float
    mixup: float                   # Beta(alpha, alpha) mixing; 0: off
    cutmix: float                  # Beta(alpha, alpha) box mixing; 0: off
    augmentation: str              # a preset of one view (`unison.data.presets`)
    head_init_std: float
    head_norm: bool                # a batch norm without parameters in front of the head (MAE's linear probe)
    source: str                    # whose recipe the defaults are

    @property
    def lr(self) -> float:
        """The peak learning rate: `base_lr` scaled linearly with the global batch."""
        return self.base_lr * self.batch_size / 256

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "lr": self.lr}


_COMMON: dict[str, Any] = {"batch_size": 256, "momentum": 0.9, "layer_decay": None, "warmup_epochs": 0.0,
                           "drop_path": 0.0, "label_smoothing": 0.0, "mixup": 0.0, "cutmix": 0.0,
                           "augmentation": "classify", "head_init_std": 0.01, "head_norm": False}
DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("fine-tune", "vit"): {**_COMMON, "epochs": 100, "optimizer": "adamw", "base_lr": 5e-4, "weight_decay": 0.05,
                           "layer_decay": 0.65, "warmup_epochs": 5.0, "drop_path": 0.1, "label_smoothing": 0.1,
                           "head_init_std": 2e-5, "source": "MAE (He et al. 2022), ViT-B fine-tuning"},
    ("fine-tune", "cnn"): {**_COMMON, "epochs": 60, "optimizer": "sgd", "base_lr": 0.05, "weight_decay": 0.0,
                           "source": "SimCLR (Chen et al. 2020), semi-supervised fine-tuning"},
}
for _family in FAMILIES:
    DEFAULTS[("linear", _family)] = {**_COMMON, "epochs": 100, "optimizer": "sgd", "base_lr": 0.1,
                                     "weight_decay": 0.0, "head_norm": True,
                                     "source": "SimCLR/MoCo linear evaluation, MAE's batch norm before the head"}
_NUMBERS = {  # name: (lowest, highest, open at the bottom)
    "epochs": (1, 100_000, False), "batch_size": (1, 2**24, False), "base_lr": (0, 1e4, True),
    "weight_decay": (0, 10, False), "momentum": (0, 1, False), "warmup_epochs": (0, 100_000, False),
    "drop_path": (0, 1, False), "label_smoothing": (0, 1, False), "mixup": (0, 100, False), "cutmix": (0, 100, False),
    "head_init_std": (0, 10, False),
}


_FLAGS = {"base_lr": "--lr", "batch_size": "--train-batch-size"}


def flag(name: str) -> str:
    """The ``unison eval`` option of recipe value `name`."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def resolve_recipe(protocol: str, family: str, given: dict[str, Any]) -> ClassifierRecipe:
    """`protocol`'s defaults for `family`, with the values in `given` that are not None; checked."""
    if protocol not in PROTOCOLS or family not in FAMILIES:
        raise ValueError(f"unknown protocol {protocol!r} or family {family!r}")
    given = {k: v for k, v in given.items() if v is not None}
    values = {**DEFAULTS[(protocol, family)], **given}
    if "warmup_epochs" not in given and isinstance(values["epochs"], int) and not isinstance(values["epochs"], bool):
        values["warmup_epochs"] *= values["epochs"] / DEFAULTS[(protocol, family)]["epochs"]   # the same share
    unknown = set(values) - {f.name for f in dataclasses.fields(ClassifierRecipe)}
    if unknown:
        raise ValueError(f"unknown recipe value(s) {sorted(unknown)}")
    for name, (lo, hi, lo_open) in _NUMBERS.items():
        v = values[name]
        whole = name in ("epochs", "batch_size")
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) \
                or not (lo < v if lo_open else lo <= v) or v > hi:
            raise ConfigError(f"{flag(name)} {v!r} must be {'an integer' if whole else 'a number'} in "
                              f"{'(' if lo_open else '['}{lo}, {hi}]")
    if values["optimizer"] not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {values['optimizer']!r} is not one of {', '.join(OPTIMIZERS)}")
    decay = values["layer_decay"]
    if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1):
        raise ConfigError(f"--layer-decay {decay!r} must be in (0, 1] (1: every block the same rate)")
    if values["warmup_epochs"] > values["epochs"]:
        raise ConfigError(f"--warmup-epochs {values['warmup_epochs']:g} is longer than the {values['epochs']} "
                          "epochs; give fewer warm-up epochs or more --epochs")
    if protocol == "linear" and (values["drop_path"] or values["layer_decay"] is not None):
        raise ConfigError("--drop-path and --layer-decay act on the backbone, which the linear protocol keeps frozen; "
                          "leave them out, or fine-tune (--fine-tune)")
    return ClassifierRecipe(protocol=protocol, family=family, **values)
