"""`unison check` for every method, as the fixtures of the sharding and accumulation tests run it.

The ViT methods run on ``vit_nano_auto`` instead of their recipe's ``vit_tiny_auto``: the same ViT code and
patching, 6 blocks of width 128 instead of 12 of 192. Exactness does not depend on the width or the depth, and
the 2-worker FSDP check of the five ViT methods took 105-109 s of CPU instead of 225-229 s (2-core CPU, two
alternating pairs). A recipe's own ViT is checked by the README's `unison check --method all`, which
tests/distributed/cli/test_readme.py runs for SimCLR and MAE.
"""

from __future__ import annotations

from typing import Any

from unison.equivalence import CheckReport, run_equivalence_all
from unison.methods import METHODS

VIT_METHODS = sorted(m for m in METHODS if METHODS[m].recipe.backbone.startswith("vit_"))


def check_every_method(world_size: int = 2, **kw: Any) -> dict[str, CheckReport]:
    """Every method's check report, by method: two launches of `world_size` workers (the CNN and the ViT methods)."""
    cnn = sorted(set(METHODS) - set(VIT_METHODS))
    reports = run_equivalence_all(cnn, world_size, **kw) + run_equivalence_all(VIT_METHODS, world_size,
                                                                               backbone="vit_nano_auto", **kw)
    return dict(zip(cnn + VIT_METHODS, reports))
