"""`unison check` for every method, as the fixtures of the sharding and accumulation tests run it.

The ViT methods run on ``vit_micro_auto`` instead of their recipe's ``vit_tiny_auto``: the same ViT code, patching
and block-by-block sharding, 2 blocks of width 128 instead of 12 of 192. Exactness does not depend on the width or
the depth. On a 2-core CPU the 2-worker FSDP check of four ViT methods (iBOT, LeJEPA, MAE, MoCo v3) took 26 s with
2 blocks and 41.5 s with nano's 6; nano had taken 105-109 s of CPU for the five where the recipe's ViT took
225-229 s. A recipe's own ViT is checked by the README's `unison check --method all`, which
tests/cli/test_readme.py runs for SimCLR and MAE.
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
                                                                               backbone="vit_micro_auto", **kw)
    return dict(zip(cnn + VIT_METHODS, reports))
