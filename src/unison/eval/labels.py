"""``--labels N|P%``: how many of the labelled training images an evaluation may learn from.

Semi-supervised evaluation (SimCLR, BYOL, MAE report 1 % and 10 % of ImageNet's labels) trains the classifier
on a class-balanced subset of the training set and scores it on the whole held-out set. `LabelBudget` parses
the option (``all``, a count ``4500`` or a share ``10%``, ``0.5%``), and `LabelBudget.count` says how many
images it is of a set of `total`: a share is rounded to the nearest image, at least one, and a count above the
set's size is refused (one line). Which images: `unison.data.subsets.balanced_subset` with the evaluation's
seed, as equal per class as the data allows, a pure function of (labels, count, seed), so a rerun, another
world size or another machine draws the same images, and another ``--seed`` another draw.

Example::

    budget = LabelBudget.parse("10%")
    n = budget.count(45_000)                     # 4500
    keep = balanced_subset(labels, n, seed=0)    # 450 per class of CIFAR-10
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from unison.errors import ConfigError

__all__ = ["LabelBudget"]

_COUNT = re.compile(r"^[0-9]{1,12}$")
_SHARE = re.compile(r"^([0-9]{1,3}(\.[0-9]{1,6})?)%$")


@dataclass(frozen=True)
class LabelBudget:
    """All labels (`share` 1.0 and `images` None), `images` of them, or a `share` in (0, 1] of them."""

    text: str = "all"
    images: int | None = None
    share: float = 1.0

    @classmethod
    def parse(cls, text: object) -> LabelBudget:
        """``all``, ``N`` (images) or ``P%`` (of the training set); one line for anything else."""
        given = str(text).strip() if isinstance(text, (str, int)) and not isinstance(text, bool) else None
        if given is None or given.lower() in ("all", "100%"):
            if given is None and text is not None:
                raise ConfigError(f"--labels {text!r} must be a count such as 500 or a share such as 10%")
            return cls()
        if _COUNT.match(given):
            if int(given) < 1:
                raise ConfigError("--labels 0 leaves nothing to learn from; give at least 1 image, a share such as "
                                  "1%, or all")
            return cls(given, images=int(given))
        m = _SHARE.match(given)
        if m and 0 < float(m.group(1)) <= 100:
            return cls(given, share=float(m.group(1)) / 100)
        raise ConfigError(f"--labels {given[:40]!r} is neither a count of images (500) nor a share of the training "
                          "set in (0, 100] % (10%, 0.5%); or give all")

    @property
    def everything(self) -> bool:
        return self.images is None and self.share == 1.0

    def count(self, total: int, what: str = "--data") -> int:
        """The number of images this budget is of a set of `total` labelled images."""
        if self.images is not None:
            if self.images > total:
                raise ConfigError(f"--labels {self.images} asks for more images than {what} has ({total:,}); give "
                                  f"at most {total:,}, a share such as 10%, or all")
            return self.images
        return max(1, min(total, math.floor(self.share * total + 0.5)))

