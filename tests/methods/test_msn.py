"""MSN and PMSN, in one process: the anchor masks (from the sample keys, the paper's count of kept patches, only
the kept patches seen), the target network (no gradient, its momentum schedule), the prototypes, the recipe's
views, and the one-line refusals. Their W=2 exactness is `unison check` (tests/helpers/every_method.py)."""

from __future__ import annotations

import pytest
import torch

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.losses import MSNLoss, PMSNLoss
from unison.methods import METHODS, SampleKeys
from unison.methods.msn import MSN, MSNParams, kept_patches
from unison.methods.pmsn import PMSN, PMSNParams
from unison.models.vit import ViT
from unison.training.resolve import resolve_recipe

SMALL = dict(proj_hidden_dim=16, proj_dim=8, n_prototypes=12)


def _build(cls: type[MSN] = MSN, **params) -> MSN:
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    return cls(vit, 16, cls.Params(**{**SMALL, **params}), steps_total=8).double()


def _views(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)] + \
        [torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2)]


KEYS = SampleKeys(seed=0, epoch=0, indices=torch.tensor([3, 14, 15, 92]))


def test_registered_with_the_papers_views():
    assert METHODS["msn"] is MSN and METHODS["pmsn"] is PMSN
    for method in ("msn", "pmsn"):
        recipe = resolve_recipe(TrainConfig(method=method, data="/data/images"), 32)
        assert (recipe.augmentation, recipe.backbone, recipe.local_crop_size) == ("msn", "vit_tiny_auto", 12)
        assert resolve_recipe(TrainConfig(method=method), 16).augmentation == "digits_multicrop"


def test_the_anchor_keeps_the_papers_count_drawn_per_sample():
    assert kept_patches(MSNParams(), 196) == 166 and kept_patches(MSNParams(), 64) == 54   # floor(N (1 - 0.15))
    model = _build(mask_ratio=0.5)
    whole = model.anchor_mask(KEYS, 16, torch.device("cpu"))
    assert whole.shape == (4, 8) and len({tuple(r.tolist()) for r in whole}) == 4
    halves = [model.anchor_mask(SampleKeys(0, 0, part), 16, torch.device("cpu")) for part in KEYS.indices.split(2)]
    assert torch.equal(torch.cat(halves), whole)          # a sample's mask does not depend on its batch (or rank)


def test_the_anchor_sees_only_its_kept_patches():
    model = _build(mask_ratio=0.5)
    views = _views()
    loss = model(views, keys=KEYS)
    kept = model.anchor_mask(KEYS, 16, torch.device("cpu"))
    dropped = sorted(set(range(16)) - set(kept[0].tolist()))
    for patch, same in ((dropped[0], True), (int(kept[0, 0]), False)):
        changed = [v.clone() for v in views]
        r, c = divmod(patch, 4)
        changed[1][0, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2] += 3.0   # the anchor view (view 1) of sample 0
        other = model(changed, keys=KEYS)
        assert torch.equal(other, loss) is same, patch


def test_gradients_reach_the_student_and_the_prototypes_not_the_target():
    model = _build()
    model(_views(), keys=KEYS).backward()
    assert model.prototypes.weight.grad is not None and model.prototypes.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.projector.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.target.parameters())
    before = [p.clone() for p in model.target.parameters()]
    with torch.no_grad():
        for p in model.projector.parameters():
            p.add_(1.0)
    model.on_after_step(0)
    moved = [(p - b).abs().max() for p, b in zip(model.target.parameters(), before)]
    assert max(moved) > 0 and int(model.step_count) == 1


def test_momentum_runs_linearly_over_one_and_a_quarter_runs():
    model = _build(momentum_base=0.996)
    assert model.momentum(0) == pytest.approx(0.996)
    assert model.momentum(8) == pytest.approx(0.996 + 0.004 / 1.25)   # the official schedule ends the run short of 1
    assert model.momentum(10) == pytest.approx(1.0) and model.momentum(100) == pytest.approx(1.0)


def test_pmsn_is_msn_with_the_prior_of_its_exponent():
    model = _build(PMSN, power_law_exponent=0.5)
    assert type(model.loss_fn) is PMSNLoss and model.loss_fn.power_law_exponent == 0.5
    assert type(_build().loss_fn) is MSNLoss
    uniform = _build(PMSN, power_law_exponent=0.0)(_views(), keys=KEYS)
    torch.testing.assert_close(uniform, _build()(_views(), keys=KEYS), rtol=1e-12, atol=1e-12)


def test_bad_parameters_and_views_are_one_line():
    with pytest.raises(ConfigError, match="MSN parameter mask_ratio=1"):
        MSNParams(mask_ratio=1.0)
    with pytest.raises(ConfigError, match="PMSN parameter power_law_exponent=-1"):
        PMSNParams(power_law_exponent=-1.0)
    with pytest.raises(ConfigError, match="power_law_exponent=nan"):
        PMSNParams(power_law_exponent=float("nan"))
    with pytest.raises(ConfigError, match="keeps none of the 4 patches"):
        MSN.check_views(MSNParams(mask_ratio=0.9), 4, [8, 8, 4])
    MSN.check_views(MSNParams(), 4, [32, 32, 12])
    with pytest.raises(ValueError, match="keys=SampleKeys"):
        _build()(_views())


def test_gather_off_is_named_in_the_check():
    assert _build().exactness_note() is None
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    model = MSN(vit, 16, MSNParams(**SMALL), gather_distributed=False)
    assert "Sinkhorn and the mean prediction" in (model.exactness_note() or "")
