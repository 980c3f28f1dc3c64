"""`OwnPieces`: the user's own backbone (with its feature width), dataset and view transform, as a value.

``unison.train(cfg, backbone=..., feature_dim=..., dataset=..., transform=..., val=...)`` and ``unison.check(...)`` wrap what
they are given in it; `OwnPieces.check_types` checks each piece's kind and `OwnPieces.apply` names them in the
configuration (``own:<module>.<Class>``: what config.json, the summary and the checkpoints record). The checks that
need the run's data and model are `unison.training.own`'s. This module imports nothing else of unison's training
package, so that the step (`unison.training.step`) and the recipe (`unison.training.resolve`) can take the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.methods import get_method

__all__ = ["OWN", "OwnPieces"]

OWN = "own:"   # the prefix of the names config.json, summaries and checkpoints give the user's pieces


@dataclass
class OwnPieces:
    """The user's backbone (with its output width), dataset and view transform; None: unison's."""

    backbone: nn.Module | None = None
    feature_dim: int | None = None
    dataset: Any = None
    transform: Callable[[Any], Any] | None = None
    val: Any = None   # labelled held-out images of `dataset`'s classes: the run's kNN queries

    @property
    def given(self) -> bool:
        return any(x is not None for x in (self.backbone, self.feature_dim, self.dataset, self.transform, self.val))

    def backbone_name(self) -> str:
        return f"{OWN}{_qualname(self.backbone)}"

    def data_name(self) -> str:
        return f"{OWN}{_qualname(self.dataset)}"

    def transform_name(self) -> str:
        """The transform's name (a function's, else its class's): what the checkpoint records of it."""
        name = getattr(self.transform, "__qualname__", None)
        return f"{OWN}{name}" if isinstance(name, str) else f"{OWN}{_qualname(self.transform)}"

    def check_types(self) -> None:
        """Each piece of the right kind, and the combinations that mean something."""
        if self.backbone is not None and not isinstance(self.backbone, nn.Module):
            raise ConfigError(f"backbone= is {type(self.backbone).__name__}; give a torch.nn.Module")
        if (self.backbone is None) != (self.feature_dim is None):
            raise ConfigError("backbone= and feature_dim= go together: the width of the features your backbone "
                              "returns for each image; give both, or neither (unison's backbone)")
        if self.feature_dim is not None and (isinstance(self.feature_dim, bool) or not isinstance(self.feature_dim, int)
                                             or self.feature_dim < 1):
            raise ConfigError(f"feature_dim={self.feature_dim!r}; give the width of your backbone's features, a "
                              "positive int")
        if self.dataset is not None and not (hasattr(self.dataset, "__getitem__") or hasattr(self.dataset, "__iter__")):
            raise ConfigError(f"dataset= is {type(self.dataset).__name__}; give a torch.utils.data.Dataset or "
                              "IterableDataset of images")
        one_pass = (self.dataset is not None and not hasattr(self.dataset, "__getitem__")
                    and hasattr(self.dataset, "__iter__") and iter(self.dataset) is self.dataset)
        if one_pass:   # a generator or iterator: empty after the first pass (and after the pre-flight's read)
            raise ConfigError(f"dataset= is an iterator ({type(self.dataset).__name__}), which reads once; give an "
                              "IterableDataset, whose __iter__ starts a new pass each epoch")
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(f"transform= is {type(self.transform).__name__}; give a callable image -> view(s)")
        if self.val is not None and self.dataset is None:
            raise ConfigError("val= holds the held-out images of dataset=; give dataset= too (unison's own data takes "
                              "--val PATH)")
        if self.val is not None and not (hasattr(self.val, "__getitem__") and hasattr(self.val, "__len__")):
            raise ConfigError(f"val= is {type(self.val).__name__}; give a map-style torch.utils.data.Dataset of "
                              "(image, label) items (__len__ and __getitem__)")
        if self.transform is not None and self.dataset is None:
            raise ConfigError("transform= makes the views of dataset= items; give dataset= too (unison's own data "
                              "uses its augmentation, --augmentation)")

    def apply(self, cfg: TrainConfig) -> None:
        """Name the pieces in `cfg` (what config.json, the summary and the checkpoints record; a resumed run must
        name the same), refusing the options they replace."""
        if self.backbone is not None:
            name = self.backbone_name()
            if cfg.backbone not in (None, name):
                raise ConfigError(f"backbone={cfg.backbone!r} in the configuration and backbone= {name[len(OWN):]} "
                                  "given: leave the configuration's backbone out")
            if cfg.backbone_args:
                raise ConfigError("backbone_args are for timm backbones; your own backbone= takes none")
            cfg.backbone = name
        if self.dataset is not None:
            clash = [f"{f}={getattr(cfg, f)!r}" for f in ("val", "subset") if getattr(cfg, f) is not None]
            if clash:
                raise ConfigError(f"{', '.join(clash)} apply to --data; with dataset= leave them out (a subset: "
                                  "torch.utils.data.Subset(dataset, indices))")
            cfg.data = self.data_name()
        if self.transform is not None and get_method(cfg.method).needs_crop_geometry:
            raise ConfigError(f"--method {cfg.method} matches its views by where they lie in the image, which unison "
                              "knows for its own augmentation only; leave transform= out (unison's augmentation of "
                              f"the {cfg.method} recipe then makes the views of your dataset)")


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ in ("__main__", "builtins") else f"{cls.__module__}.{cls.__qualname__}"
