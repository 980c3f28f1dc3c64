"""CAPI in one process: the recipe, the inverse block masks (the official algorithm on the same draws, from the
sample keys), the predicted patches, what the student and the teacher see, which loss trains which parameters, the
teacher's momentum schedule and EMA, the rank-local state, and the one-line refusals. Its W=2 exactness:
``unison check --method capi`` (tests/helpers/every_method.py) and the second part of this file:

CAPI's pieces at W=2 (real gloo processes) against one process on the global batch: the positionwise Sinkhorn
targets are the rows of the single-process targets (the shift a global maximum, the sums global), both losses and
their gradients averaged over ranks as DDP does equal the single-process ones, and each rank's inverse block masks
are the rows of one process's. The whole method: ``unison check --method capi`` (tests/helpers/every_method.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unison.config import TrainConfig
from unison.distributed.tagging import rank_local_state_names
from unison.distributed.testing import run_in_workers
from unison.errors import ConfigError
from unison.methods import METHODS, SampleKeys
from unison.methods.capi import CAPI, CAPIParams, masked_count
from unison.methods.masking import inverse_block_masking
from unison.models.vit import ViT
from unison.rng import sample_uniform
from unison.training.resolve import resolve_recipe

SMALL = dict(n_clusters=12, predictor_depth=1)
KEYS = SampleKeys(seed=0, epoch=0, indices=torch.tensor([3, 14, 15, 92]))


def _build(**params) -> CAPI:
    torch.manual_seed(0)
    vit = ViT(img_size=16, patch_size=2, embed_dim=16, depth=1, num_heads=2)   # 8 x 8 patches
    return CAPI(vit, 16, CAPIParams(**{**SMALL, **params}), steps_total=100).double()


def _images(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_registered_with_the_official_recipe():
    assert METHODS["capi"] is CAPI
    recipe = resolve_recipe(TrainConfig(method="capi", data="/data/images"), 32)
    assert (recipe.augmentation, recipe.optimizer, recipe.weight_decay, recipe.backbone) == \
        ("capi", "adamw", 0.1, "vit_tiny_auto")
    assert CAPI.recipe.base_lr == pytest.approx(1e-3 * 256 / 16384)   # 1e-3 at the official batch of 16384
    digits = resolve_recipe(TrainConfig(method="capi"), 16)
    assert (digits.augmentation, digits.backbone) == ("digits_crop", "vit_nano_p4")   # as the other ViT methods


def _official_visible(u: list[float], grid: int, n_visible: int) -> np.ndarray:
    """The official InverseBlockMasking's visible patches (BlockMasking of n_visible, rolled) on the uniforms u."""
    lo = max(math.log(0.5), math.log(n_visible / grid ** 2))
    hi = min(math.log(2.0), math.log(grid ** 2 / (n_visible + 1e-5)))
    aspect = math.exp(lo + (hi - lo) * u[0])
    h, w = min(grid, math.ceil(math.sqrt(n_visible * aspect))), min(grid, math.ceil(math.sqrt(n_visible / aspect)))
    block = np.zeros((grid, grid), dtype=bool)
    top, left = int(u[1] * (grid - h + 1)), int(u[2] * (grid - w + 1))
    block[top:top + h, left:left + w] = True
    visible = np.zeros(grid * grid, dtype=bool)
    visible[np.where(block.flatten())[0][:n_visible]] = True
    return np.roll(visible.reshape(grid, grid), (int(u[3] * grid), int(u[4] * grid)), (0, 1)).flatten()


@pytest.mark.parametrize("grid", [4, 8, 14])
def test_the_masks_are_the_official_inverse_blocks_drawn_per_sample(grid):
    n_patches = grid * grid
    m = masked_count(CAPIParams(), n_patches)
    assert m == int(n_patches * 0.65)
    keys = SampleKeys(seed=1, epoch=2, indices=torch.arange(300))
    visible, masked = inverse_block_masking(keys, 5, grid, m)
    assert visible.shape == (300, n_patches - m) and masked.shape == (300, m)
    assert torch.equal(torch.cat([visible, masked], 1).sort(dim=1).values, torch.arange(n_patches).expand(300, -1))
    u = sample_uniform(1, 2, keys.indices, 5, 5).double()
    for b in range(300):
        mine = np.zeros(n_patches, dtype=bool)
        mine[visible[b].numpy()] = True
        assert (mine == _official_visible(u[b].tolist(), grid, n_patches - m)).all(), b
    halves = [inverse_block_masking(SampleKeys(1, 2, part), 5, grid, m)[0] for part in keys.indices.split(7)]
    assert torch.equal(torch.cat(halves), visible)                 # a sample's mask does not depend on its batch


def test_the_predicted_patches_are_a_per_sample_share_of_the_masked_ones():
    model = _build()
    visible, masked, predicted = model.masks(KEYS, 0, 8, torch.device("cpu"))
    assert masked.shape == (4, 41) and visible.shape == (4, 23) and torch.equal(predicted, masked)   # the default
    sub = _build(prediction_subsampling=0.05)
    _, masked, predicted = sub.masks(KEYS, 0, 8, torch.device("cpu"))
    assert predicted.shape == (4, 2)                               # official int(41 * 0.05)
    assert all(set(p.tolist()) <= set(q.tolist()) for p, q in zip(predicted, masked))
    assert len({tuple(p.tolist()) for p in predicted}) == 4
    assert sub.masks(KEYS, 0, 4, torch.device("cpu"))[2].shape == (4, 1)   # at least one: int(10 * 0.05) = 0
    assert not torch.equal(model.masks(KEYS, 1, 8, torch.device("cpu"))[0], visible)   # each view its own


def test_the_student_sees_the_visible_patches_only():
    """The teacher reads every patch without gradient: the loss's gradient in the image is the student's, which is
    0 on the masked patches and not on the visible ones."""
    model = _build()
    x = _images().requires_grad_(True)
    model([x], keys=KEYS).backward()
    visible, masked, _ = model.masks(KEYS, 0, 8, torch.device("cpu"))
    per_patch = x.grad.abs().reshape(4, 3, 8, 2, 8, 2).sum(dim=(1, 3, 5)).reshape(4, 64)
    assert (per_patch.gather(1, masked) == 0).all() and (per_patch.gather(1, visible) > 0).all()


def test_each_loss_trains_its_own_parameters():
    """L_capi the student (backbone, predictor, head), L_clust the clustering head; the teacher no gradient."""
    model = _build()
    model([_images()], keys=KEYS).backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(full) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(p.requires_grad for p in model.teacher.parameters())
    model.zero_grad(set_to_none=True)
    losses = []
    model.loss_fn.register_forward_hook(lambda module, args, out: losses.append(out))
    model([_images()], keys=KEYS)
    capi, clust = losses[0]
    for loss, owned in ((capi, lambda n: not n.startswith("clustering.")), (clust, lambda n: n.startswith("clustering."))):
        names = [n for n in full if owned(n)]
        grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names], retain_graph=True)
        for n, g in zip(names, grads):
            torch.testing.assert_close(g, full[n], rtol=1e-12, atol=1e-12, msg=n)


def _official_momentum(total: int, base: float = 0.999, warmup_fraction: float = 0.1) -> np.ndarray:
    """The official WarmupThenCosine(base, final=1, warmup, start_warmup_value=1, truncate_cos=0.8)."""
    warmup = round(warmup_fraction * total)
    iters = np.arange(total - warmup)
    cosine = 1.0 + 0.5 * (base - 1.0) * (1 + np.cos(np.pi * 0.8 * iters / len(iters)))
    return np.concatenate((np.linspace(1.0, base, warmup), cosine))


def test_the_momentum_is_the_official_schedule():
    model = _build()
    torch.testing.assert_close(torch.tensor([model.momentum(s) for s in range(100)], dtype=torch.float64),
                               torch.from_numpy(_official_momentum(100)), rtol=0, atol=1e-15)
    assert model.momentum(0) == 1.0 and model.momentum(9) == pytest.approx(0.999) and model.momentum(100) == 1.0


def test_the_teacher_follows_the_student_and_is_rank_local():
    model = _build()
    before = [p.clone() for p in model.teacher.parameters()]
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(1.0)
    model.on_after_step(0)                                        # momentum 1 at the first step: no move
    assert all(torch.equal(p, b) for p, b in zip(model.teacher.parameters(), before))
    model.on_after_step(50)
    m = model.momentum(50)
    for t, b, s in zip(model.teacher.backbone.parameters(), before, model.backbone.parameters()):
        torch.testing.assert_close(t, m * b + (1 - m) * s)
    names = set(rank_local_state_names(model))
    assert names and all(n.startswith("teacher.") for n in names)
    assert {f"teacher.{n}" for n, _ in model.teacher.named_parameters()} <= set(model.state_dict()) & names


def test_bad_parameters_views_and_calls_are_one_line():
    with pytest.raises(ConfigError, match="CAPI parameter prediction_subsampling=0"):
        CAPIParams(prediction_subsampling=0.0)
    with pytest.raises(ConfigError, match="CAPI parameter n_clusters=1"):
        CAPIParams(n_clusters=1)
    with pytest.raises(ConfigError, match="CAPI parameter teacher_temp"):
        CAPIParams(teacher_temp=0.0)
    with pytest.raises(ConfigError, match="masks 0 of 4 patches"):
        CAPI.check_views(CAPIParams(mask_ratio=0.2), 8, [16])
    with pytest.raises(ConfigError, match="masks 4 of 4 patches"):
        CAPI.check_views(CAPIParams(mask_ratio=1.0), 8, [16])
    CAPI.check_views(CAPIParams(), 4, [32])
    with pytest.raises(ValueError, match="keys=SampleKeys"):
        _build()([_images()])
    with pytest.raises(ValueError, match="needs a ViT backbone"):
        CAPI(torch.nn.Linear(3, 3), 3, CAPIParams(**SMALL))


def test_gather_off_is_named_in_the_check():
    assert _build().exactness_note() is None
    torch.manual_seed(0)
    vit = ViT(img_size=16, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    model = CAPI(vit, 16, CAPIParams(**SMALL), gather_distributed=False)
    assert "Sinkhorn-Knopp balances each rank's local batch" in (model.exactness_note() or "")


def test_embed_is_the_mean_patch_token():
    model = _build()
    x = _images()
    torch.testing.assert_close(model.embed(x), model.backbone.forward_tokens(x)[:, 1:].mean(dim=1))


# -- with real processes --


INDICES = torch.tensor([31, 4, 17, 99, 2, 56, 8, 1000])


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 6, 5, generator=g, dtype=torch.float64) * 4
    teacher[5:] += 9.0              # the second rank's maxima lie above the first's: the shift must be global
    student = torch.randn(8, 3, 5, generator=g, dtype=torch.float64)
    predicted = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(8)])
    return teacher, student, predicted


def _worker() -> dict[str, torch.Tensor]:
    from unison.distributed import collectives as C
    from unison.losses import CAPILoss, positionwise_sinkhorn
    from unison.methods import SampleKeys
    from unison.methods.masking import inverse_block_masking

    rows = C.local_slice(8)
    teacher, student, predicted = (x[rows] for x in _inputs())
    t, s = teacher.clone().requires_grad_(True), student.clone().requires_grad_(True)
    capi, clust = CAPILoss()(t, s, predicted)
    (capi + 2 * clust).backward()           # DDP averages the ranks' gradients: each rank's own rows, / W
    keys = SampleKeys(seed=5, epoch=1, indices=INDICES[rows])
    return {"targets": positionwise_sinkhorn(teacher / 0.06), "capi": C.all_reduce_no_grad(capi, average=True),
            "clust": C.all_reduce_no_grad(clust, average=True), "t_grad": t.grad / C.world_size(),
            "s_grad": s.grad / C.world_size(), "visible": inverse_block_masking(keys, 3, 8, 41)[0]}


@pytest.mark.distributed
def test_capi_pieces_at_two_ranks_equal_one_process():
    multi = run_in_workers(_worker, 2)
    single = run_in_workers(_worker, 1, backend="local")[0]
    for key in ("targets", "t_grad", "s_grad", "visible"):
        torch.testing.assert_close(torch.cat([multi[0][key], multi[1][key]]), single[key], rtol=1e-12, atol=1e-12,
                                   msg=key)
    for key in ("capi", "clust"):
        for r in (0, 1):
            torch.testing.assert_close(multi[r][key], single[key], rtol=1e-12, atol=1e-12, msg=key)
