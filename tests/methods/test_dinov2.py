"""DINOv2, in one process: its masks (DINOv2's block generator, drawn per sample and crop, padded with weights),
the whole loss against DINOv2's official formulas (its collator's weights, Sinkhorn-Knopp and KoLeo, written out
here), the pieces Lightly 1.6.0 ships (DINOLoss, IBOTPatchLoss, KoLeoLoss: 1e-9 in float64), the heads, the
recipe and the one-line refusals. Its W=2 exactness is `unison check` (tests/helpers/every_method.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.losses import IBOTLoss, KoLeoLoss
from unison.methods import METHODS, SampleKeys
from unison.methods.dinov2 import DINOv2, DINOv2Params
from unison.methods.masking import MAX_MASK_TRIES, _uniform, dinov2_masking, padded_masked
from unison.models.vit import ViT
from unison.training.resolve import resolve_recipe

SMALL = dict(hidden_dim=16, bottleneck_dim=8, out_dim=32)
KEYS = SampleKeys(seed=0, epoch=0, indices=torch.tensor([3, 14, 15, 92, 65, 35]))


def _build(cls: type[DINOv2] = DINOv2, steps_total: int = 8, **params) -> DINOv2:
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    return cls(vit, 16, cls.Params(**{**SMALL, **params}), steps_total=steps_total).double()


def _views(n: int = 6, seed: int = 0, local: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)] + \
        [torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(local)]


# ------------------------------------------------------------------ DINOv2's official code, one process
def _official_mask(u: list[float], grid: int, probability: float, lo: float, hi: float) -> list[list[bool]]:
    """collate_data_and_cast's draw for one crop and MaskingGenerator (dinov2/data/masking.py), reading the
    uniforms `u` in order: [masked?, ratio, then 4 per try]."""
    n_patches = grid * grid
    target = int(n_patches * (lo + (hi - lo) * u[1])) if u[0] < probability else 0
    mask = [[False] * grid for _ in range(grid)]
    count, t = 0, 0
    log_aspect = (math.log(0.3), math.log(1 / 0.3))
    while count < target:
        max_mask = min(target - count, n_patches // 2)
        delta = 0
        for _ in range(10):
            if t == MAX_MASK_TRIES:
                return mask
            ua, ur, ut, ul = u[2 + 4 * t:6 + 4 * t]
            t += 1
            area = 4 + (max_mask - 4) * ua
            aspect = math.exp(log_aspect[0] + (log_aspect[1] - log_aspect[0]) * ur)
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if w < grid and h < grid:
                top, left = math.floor(ut * (grid - h + 1)), math.floor(ul * (grid - w + 1))
                already = sum(mask[i][j] for i in range(top, top + h) for j in range(left, left + w))
                if 0 < h * w - already <= max_mask:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if not mask[i][j]:
                                mask[i][j] = True
                                delta += 1
            if delta > 0:
                break
        if delta == 0:
            break
        count += delta
    return mask


def _sinkhorn_knopp_teacher(teacher_output: torch.Tensor, teacher_temp: float, iterations: int = 3) -> torch.Tensor:
    """dinov2/loss/dino_clstoken_loss.py (and ibot_patch_loss.py, whose B is the masked patches' count), W = 1."""
    q = torch.exp(teacher_output / teacher_temp).t()
    b, k = q.shape[1], q.shape[0]
    q /= torch.sum(q)
    for _ in range(iterations):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= b
    q *= b
    return q.t()


def _official_koleo(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """dinov2/loss/koleo_loss.py."""
    x = F.normalize(x, eps=eps, p=2, dim=-1)
    dots = torch.mm(x, x.t())
    n = x.shape[0]
    dots.view(-1)[:: (n + 1)].fill_(-1)
    nearest = torch.max(dots, dim=1)[1]
    distances = torch.nn.PairwiseDistance(2, eps=1e-8)(x, x[nearest])
    return -torch.log(distances + eps).mean()


def _official_loss(model: DINOv2, views: list[torch.Tensor], keys: SampleKeys, step: int) -> torch.Tensor:
    """SSLMetaArch.forward_backward's loss (dinov2/train/ssl_meta_arch.py) with Sinkhorn-Knopp, one process."""
    p, n = model.params, views[0].shape[0]
    n_local = len(views) - 2
    grid = model.backbone.grid_size(views[0].shape[-1])
    masks = model.patch_masks(keys, grid, torch.device("cpu")).is_masked          # [2n, N], crop-major
    mask_indices = masks.flatten().nonzero().flatten()
    masks_weight = (1 / masks.sum(-1).clamp(min=1).double()).unsqueeze(-1).expand_as(masks)[masks]   # float64 here
    patch_head = model.ibot_head if p.separate_head else model.head
    teacher_patch_head = model.teacher.ibot_head if p.separate_head else model.teacher.head
    temp = model.teacher_temp(step)
    globals_ = torch.cat(views[:2])
    with torch.no_grad():
        t = model.teacher.backbone.forward_tokens(globals_)
        t_cls = t[:, 0].chunk(2)
        t_cls = model.teacher.head(torch.cat((t_cls[1], t_cls[0])))             # A matched to B
        t_patch = teacher_patch_head(t[:, 1:].flatten(0, 1)[mask_indices])
        q_cls = _sinkhorn_knopp_teacher(t_cls, temp).view(2, n, -1)
        q_patch = _sinkhorn_knopp_teacher(t_patch, temp)
    s = model.backbone.forward_tokens(globals_, mask=masks, mask_token=model.mask_token)
    s_local = model.head(model.backbone(torch.cat(views[2:])))
    s_global = model.head(s[:, 0])
    s_patch = patch_head(s[:, 1:].flatten(0, 1)[mask_indices])
    terms = 2 + 2 * n_local

    def dino(students: list[torch.Tensor], teachers: list[torch.Tensor]) -> torch.Tensor:
        return -sum((q * F.log_softmax(x / 0.1, dim=-1)).sum(dim=-1).mean() for x in students for q in teachers)

    loss = dino(list(s_local.chunk(n_local)), list(q_cls)) / terms
    loss = loss + dino([s_global], [q_cls.flatten(0, 1)]) * 2 / terms
    loss = loss + p.koleo_weight * sum(_official_koleo(c) for c in s[:, 0].chunk(2))
    ibot = (q_patch * F.log_softmax(s_patch / 0.1, dim=-1)).sum(dim=-1)
    return loss - (ibot * masks_weight).sum() / masks.shape[0]


# ------------------------------------------------------------------ masks
@pytest.mark.parametrize("grid", [4, 8, 14])
def test_masks_are_dinov2s_block_generator_drawn_per_sample(grid):
    keys = SampleKeys(seed=3, epoch=1, indices=torch.arange(300))
    got = dinov2_masking(keys, 77, grid, 0.5, (0.1, 0.5))
    u = _uniform(keys, 77, 2 + 4 * MAX_MASK_TRIES, None).double()
    for b in range(300):
        ref = torch.tensor(_official_mask(u[b].tolist(), grid, 0.5, 0.1, 0.5)).flatten()
        assert torch.equal(got[b], ref), b
    counts = got.sum(dim=1)
    n_patches = grid * grid
    assert counts.max() <= n_patches // 2 and 0.4 < (counts > 0).double().mean() < 0.6   # half the crops masked
    halves = [dinov2_masking(SampleKeys(3, 1, part), 77, grid, 0.5, (0.1, 0.5)) for part in keys.indices.split(100)]
    assert torch.equal(torch.cat(halves), got)           # a sample's mask does not depend on its batch (or rank)
    both = dinov2_masking(keys, 76, grid, 0.5, (0.1, 0.5), crops=2)                # crop c from stream 76 + c
    assert torch.equal(both[300:], got) and torch.equal(both[:300], dinov2_masking(keys, 76, grid, 0.5, (0.1, 0.5)))


def test_masked_patches_are_listed_at_one_width_with_weights():
    is_masked = torch.tensor([[True, False, True, False], [False] * 4, [False, False, False, True]])
    at, weights = padded_masked(is_masked, 2)
    assert at[0].tolist() == [0, 2] and at[2, 0] == 3
    assert weights.tolist() == [[0.5, 0.5], [0.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="cannot list up to 5"):
        padded_masked(is_masked, 5)


def test_the_model_masks_both_crops_with_their_own_draws():
    model = _build()
    masks = model.patch_masks(KEYS, 4, torch.device("cpu"))
    assert masks.is_masked.shape == (12, 16) and masks.at.shape == (12, 8) and masks.weights is not None
    assert not torch.equal(masks.is_masked[:6], masks.is_masked[6:])
    torch.testing.assert_close(masks.weights.sum(dim=1), (masks.is_masked.sum(dim=1) > 0).double())


def test_masks_run_on_plans_fake_tensors_without_reading_a_value():
    """`unison plan` runs the step on fake tensors: a mask loop that read a value there would never end (every
    read answers 1) or be a device sync per try."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unison.plan.fake import HostSyncRecorder

    with FakeTensorMode(allow_non_fake_inputs=True), HostSyncRecorder() as recorder:
        mask = dinov2_masking(SampleKeys(0, 0, torch.arange(4)), 5, 14, 0.5, (0.1, 0.5))
        padded_masked(mask, 98)
    assert mask.shape == (4, 196) and recorder.syncs == []


# ------------------------------------------------------------------ the loss
@pytest.mark.parametrize("separate_head", [False, True])
def test_loss_equals_dinov2s_official_formulas(separate_head):
    model = _build(separate_head=separate_head)
    views = _views()
    for step in (0, 3):
        model.step_count.fill_(step)
        got = model(views, keys=KEYS)
        torch.testing.assert_close(got, _official_loss(model, views, KEYS, step), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("centering", ["sinkhorn", "centre"])
def test_padding_takes_no_part_in_the_loss_sinkhorn_or_the_centre(centering):
    g = torch.Generator().manual_seed(4)
    n, m, k = 4, 3, 10
    weights = torch.tensor([[1 / 3] * 3, [0.5, 0.5, 0], [0, 0, 0], [1, 0, 0]] * 2, dtype=torch.float64)
    s_cls = [torch.randn(n, k, generator=g, dtype=torch.float64) for _ in range(3)]
    t_cls = [torch.randn(n, k, generator=g, dtype=torch.float64) for _ in range(2)]
    s_patch, t_patch = torch.randn(2, 2 * n, m, k, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 2 * n, m, k, generator=g, dtype=torch.float64) * 5 * (weights == 0).unsqueeze(-1)
    results = []
    for s, t in ((s_patch, t_patch), (s_patch + noise[0], t_patch + noise[1])):
        loss_fn = IBOTLoss(k, centering=centering).double()
        out = loss_fn(s_cls, t_cls, list(s.split(n)), list(t.split(n)), 0.05, list(weights.split(n)))
        results.append((*out, loss_fn.patch_center.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_heads_shared_or_separate_and_the_teacher_takes_no_gradient():
    shared, separate = _build(), _build(separate_head=True)
    assert not hasattr(shared, "ibot_head") and not hasattr(shared.teacher, "ibot_head")
    separate(_views(), keys=KEYS).backward()
    for head in (separate.head, separate.ibot_head):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters() if p.dim() > 1)
    assert all(p.grad is None and not p.requires_grad for p in separate.teacher.parameters())
    before = separate.teacher.ibot_head.mlp[0].weight.clone()
    with torch.no_grad():
        separate.ibot_head.mlp[0].weight.add_(1.0)
    separate.on_after_step(0)
    assert not torch.equal(separate.teacher.ibot_head.mlp[0].weight, before) and int(separate.step_count) == 1
    assert separate.momentum(0) == pytest.approx(0.992) and separate.momentum(8) == pytest.approx(1.0)
    assert separate.teacher_temp(0) == pytest.approx(0.04) and separate.teacher_temp(3) == pytest.approx(0.07)


# ------------------------------------------------------------------ Lightly 1.6.0's DINOv2 pieces
def test_patch_and_class_losses_equal_lightlys_with_centring():
    lightly_loss = pytest.importorskip("lightly.loss")
    g = torch.Generator().manual_seed(1)
    # a temperature and weights (1 / count) float32 holds exactly: Lightly makes them float32 tensors
    n, m, k, tt = 5, 4, 12, 0.0625
    is_masked = torch.zeros(2 * n, 9, dtype=torch.bool)
    for b, count in enumerate([0, 2, 4, 1, 0, 4, 0, 0, 2, 1]):
        is_masked[b, torch.randperm(9, generator=g)[:count]] = True
    at, weights = padded_masked(is_masked, m)
    s_tokens, t_tokens = torch.randn(2, 2 * n, 9, k, generator=g, dtype=torch.float64)
    s_patch = s_tokens.gather(1, at.unsqueeze(-1).expand(-1, -1, k)).requires_grad_()
    t_patch = t_tokens.gather(1, at.unsqueeze(-1).expand(-1, -1, k))
    s_cls = [torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    t_cls = [torch.randn(n, k, generator=g, dtype=torch.float64) for _ in range(2)]
    mine = IBOTLoss(k, centering="centre").double()
    cls, patch = mine(s_cls, t_cls, list(s_patch.split(n)), list(t_patch.split(n)), tt, list(weights.split(n)))

    theirs_patch = lightly_loss.IBOTPatchLoss(output_dim=k, teacher_temp=tt).double()
    lightly_patch = theirs_patch(t_tokens[is_masked], s_patch.view(2 * n * m, k)[weights.flatten() > 0],
                                 is_masked.view(2 * n, 3, 3), teacher_temp=tt)
    theirs_cls = lightly_loss.DINOLoss(output_dim=k, teacher_temp=tt).double()
    lightly_cls = theirs_cls(t_cls, s_cls, teacher_temp=tt)
    torch.testing.assert_close(patch, lightly_patch, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cls, lightly_cls, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(mine.patch_center, theirs_patch.center.value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(mine.center, theirs_cls.center.view(1, k), rtol=1e-9, atol=1e-12)
    grads = torch.autograd.grad(cls + patch, [s_patch, *s_cls])
    theirs = torch.autograd.grad(lightly_cls + lightly_patch, [s_patch, *s_cls])
    for a, b in zip(grads, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_koleo_equals_lightlys_with_its_gradient():
    lightly_loss = pytest.importorskip("lightly.loss")
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
    mine, theirs = KoLeoLoss()(x), lightly_loss.KoLeoLoss()(x)
    torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(mine, x)[0], torch.autograd.grad(theirs, x)[0], rtol=1e-9,
                               atol=1e-12)


def test_sinkhorn_of_padded_rows_is_sinkhorn_of_the_valid_rows():
    from unison.losses import sinkhorn

    scores = torch.randn(10, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    valid = torch.tensor([True, False, True, True, False, False, True, True, False, True])
    codes = sinkhorn(scores, epsilon=0.05, valid=valid)
    torch.testing.assert_close(codes[valid], _sinkhorn_knopp_teacher(scores[valid], 0.05), rtol=1e-12, atol=1e-14)
    assert torch.equal(codes[~valid], torch.zeros_like(codes[~valid]))
    assert torch.equal(sinkhorn(scores, valid=torch.zeros(10, dtype=torch.bool)), torch.zeros_like(scores))


# ------------------------------------------------------------------ recipe and refusals
def test_registered_with_dinov2s_recipe_and_defaults():
    assert METHODS["dinov2"] is DINOv2
    recipe = resolve_recipe(TrainConfig(method="dinov2", data="/data/images"), 224)
    assert (recipe.optimizer, recipe.lr, recipe.weight_decay, recipe.augmentation, recipe.backbone) == \
        ("adamw", 1e-3, 0.04, "dinov2", "vit_tiny_auto")
    assert recipe.local_crop_size == 96
    from unison.data.augment import PRESETS

    assert (PRESETS["dinov2"]["n_local"], PRESETS["dinov2"]["crop_scale"], PRESETS["dinov2"]["local_crop_scale"]) == \
        (8, (0.32, 1.0), (0.05, 0.32))
    assert resolve_recipe(TrainConfig(method="dinov2"), 16).augmentation == "digits_multicrop"
    p = DINOv2Params()
    assert (p.centering, p.separate_head, p.koleo_weight, p.cls_weight, p.patch_weight) == ("sinkhorn", False, 0.1, 1, 1)
    assert (p.mask_probability, p.mask_ratio_min, p.mask_ratio_max, p.momentum_base) == (0.5, 0.1, 0.5, 0.992)
    assert (p.warmup_teacher_temp, p.teacher_temp, p.teacher_temp_warmup_fraction) == (0.04, 0.07, 0.3)


def test_bad_parameters_and_views_are_one_line():
    with pytest.raises(ConfigError, match="mask_ratio_min=0.6 and mask_ratio_max=0.5 must satisfy"):
        DINOv2Params(mask_ratio_min=0.6)
    with pytest.raises(ConfigError, match="DINOv2 parameter centering='mean'"):
        DINOv2Params(centering="mean")
    with pytest.raises(ConfigError, match="DINOv2 parameter mask_probability=2"):
        DINOv2Params(mask_probability=2.0)
    with pytest.raises(ConfigError, match="masks none of the 1 patches"):
        DINOv2.check_views(DINOv2Params(), 8, [8, 8, 4])
    DINOv2.check_views(DINOv2Params(), 4, [32, 32, 12])
    with pytest.raises(ValueError, match="DINOv2 draws its masks per sample"):
        _build()(_views())
    assert "Sinkhorn" in (DINOv2(ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2), 16,
                                 DINOv2Params(**SMALL), gather_distributed=False).exactness_note() or "")
