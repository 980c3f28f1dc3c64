"""Single-process checks of the ViT backbones, the masks, the momentum teacher and the ViT-era methods.

The ViT-era methods at W=2 (real gloo processes) equal one process on the global batch.

One 2-process launch runs, for MAE, iBOT (centring and Sinkhorn), I-JEPA, LeJEPA and MoCo v3,
`unison.equivalence.record_steps` — the production step of `unison train` (method, DDP, the
recipe's AdamW and schedule, float64) on DIFFERENT data per rank, a tiny ViT
(``vit_micro_p4``, 2 blocks, on 16 px images: 16 patches) and 3 steps, so masks, EMA teachers, centres
and step-dependent SIGReg directions are exercised. The references run in one process.

The same launch checks, below the method level:

* masks: each rank draws the masks of its slice of a global batch of sample indices; they
  equal the rows of one process's masks of the whole batch (W=1 vs W=2, same indices);
* SIGReg and KoLeo gradients: z = X_r @ theta on each rank, the rank's loss backpropagated
  and the theta gradients averaged as DDP does; they equal the single-process gradient of
  the loss on the global batch (a non-differentiable all-reduce, Lightly's SIGReg bug
  lightly#1920, gives 1/W of it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.distributed.tagging import rank_local_state_names
from unison.distributed.testing import run_in_workers
from unison.equivalence import max_rel_difference
from unison.errors import ConfigError
from unison.methods import METHODS, MomentumTeacher, SampleKeys
from unison.methods.masking import block_masking, random_masking
from unison.models import VIT_BACKBONES, ViT, build_backbone
from unison.training.resolve import resolve_recipe, validate_run

VIT_METHODS = ("mae", "ibot", "ijepa", "lejepa", "mocov3")


SMALL = {
    "mae": dict(decoder_dim=8, decoder_depth=1, decoder_heads=2),
    "ibot": dict(hidden_dim=8, bottleneck_dim=4, out_dim=16),
    "ijepa": dict(predictor_dim=8, predictor_depth=1, predictor_heads=2, num_targets=2),
    "lejepa": dict(proj_hidden_dim=8, proj_dim=4, num_slices=8),
    "mocov3": dict(proj_hidden_dim=8, proj_dim=4, pred_hidden_dim=8),
}


def _vit(img_size: int = 8) -> ViT:
    return ViT(img_size=img_size, patch_size=2, embed_dim=16, depth=1, num_heads=2)


def _views(name: str, n: int = 6, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    count = {"mae": 1, "ijepa": 1, "mocov3": 2}.get(name, 2)
    views = [torch.randn(n, 3, 8, 8, generator=g) for _ in range(count)]
    if name in ("ibot", "lejepa"):
        views += [torch.randn(n, 3, 4, 4, generator=g) for _ in range(2)]      # local crops: 2 x 2 patches
    return views


def _build(name: str, backbone: nn.Module | None = None, **params) -> nn.Module:
    torch.manual_seed(0)
    cls = METHODS[name]
    backbone = backbone if backbone is not None else _vit()
    return cls(backbone, 16, cls.Params(**{**SMALL[name], **params}), steps_total=4)


def _step(model: nn.Module, name: str, step: int, n: int = 6) -> torch.Tensor:
    keys = SampleKeys(seed=0, epoch=0, indices=torch.arange(n) + 100 * step)
    kw = {"keys": keys} if type(model).needs_sample_keys else {}
    return model(_views(name, n, step), **kw)


# ------------------------------------------------------------------------------ ViT backbone
def test_vit_backbone_names_and_shapes():
    assert {"vit_tiny", "vit_small", "vit_base", "vit_tiny_p4", "vit_nano_p2"} <= set(VIT_BACKBONES)
    vit, dim = build_backbone("vit_nano_p2")
    assert dim == 128 and isinstance(vit.blocks, nn.ModuleList) and len(vit.blocks) == 6
    x = torch.randn(2, 3, 16, 16)
    assert vit(x).shape == (2, 128)
    assert vit.forward_tokens(x).shape == (2, 1 + 64, 128)
    assert vit.forward_tokens(x, keep=torch.tensor([[0, 5, 9], [1, 2, 63]])).shape == (2, 4, 128)
    assert vit(torch.randn(2, 3, 8, 8)).shape == (2, 128)           # other sizes: resampled positions
    with pytest.raises(ValueError, match="multiple of the patch size"):
        vit(torch.randn(2, 3, 9, 9))


def test_vit_state_dict_loads_into_timm_and_computes_the_same():
    from timm.models.vision_transformer import VisionTransformer

    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2).eval()
    ref = VisionTransformer(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2, num_classes=0).eval()
    ref.load_state_dict(vit.state_dict())                          # strict: the same names and shapes
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(vit(x), ref(x))


def test_masked_tokens_use_the_mask_token():
    vit = _vit()
    x = torch.randn(2, 3, 8, 8)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    token = nn.Parameter(torch.randn(1, 1, 16))
    torch.testing.assert_close(vit.forward_tokens(x, mask=mask, mask_token=token), vit.forward_tokens(x))
    mask[0, 3] = True
    x2 = x.clone()
    x2[0, :, 0:2, 6:8] = 100.0                                      # patch 3 (row 0, column 3) changed ...
    torch.testing.assert_close(vit.forward_tokens(x2, mask=mask, mask_token=token),
                               vit.forward_tokens(x, mask=mask, mask_token=token))  # ... but masked: no effect


# ------------------------------------------------------------------------------ masks
def test_masks_depend_on_the_sample_not_on_the_batch():
    idx = torch.tensor([5, 17, 3, 99, 42, 8, 1000, 7])
    whole = SampleKeys(seed=3, epoch=2, indices=idx)
    halves = [SampleKeys(seed=3, epoch=2, indices=part) for part in idx.split(4)]     # two "ranks"
    vis, msk = random_masking(whole, 11, 64, 48)
    for r, keys in enumerate(halves):
        v, m = random_masking(keys, 11, 64, 48)
        assert torch.equal(v, vis[4 * r:4 * r + 4]) and torch.equal(m, msk[4 * r:4 * r + 4])
    tgt, ctx = block_masking(whole, 21, 8, 4, (3, 4))
    for r, keys in enumerate(halves):
        t, c = block_masking(keys, 21, 8, 4, (3, 4))
        assert torch.equal(t, tgt[4 * r:4 * r + 4]) and torch.equal(c, ctx[4 * r:4 * r + 4])
    other_epoch = random_masking(SampleKeys(seed=3, epoch=3, indices=idx), 11, 64, 48)[1]
    assert not torch.equal(other_epoch, msk)


def test_random_masking_partitions_the_patches():
    keys = SampleKeys(seed=0, epoch=0, indices=torch.arange(10))
    vis, msk = random_masking(keys, 0, 16, 12)
    assert vis.shape == (10, 4) and msk.shape == (10, 12)
    for v, m in zip(vis, msk):
        assert sorted(v.tolist() + m.tolist()) == list(range(16))
        assert v.tolist() == sorted(v.tolist()) and m.tolist() == sorted(m.tolist())
    assert len({tuple(m.tolist()) for m in msk}) > 1                       # samples differ


def test_block_masking_draws_rectangles_and_a_disjoint_context():
    keys = SampleKeys(seed=0, epoch=1, indices=torch.arange(50))
    grid, (h, w) = 8, (3, 2)
    targets, context = block_masking(keys, 7, grid, 4, (h, w))
    assert targets.shape == (50, 4, 6) and context.shape == (50, 64 - 24)
    shapes = set()
    for t_sample, c_sample in zip(targets, context):
        assert len(set(c_sample.tolist())) == 40 and not set(c_sample.tolist()) & set(t_sample.flatten().tolist())
        for block in t_sample:
            rows, cols = (block // grid).tolist(), (block % grid).tolist()
            shape = (max(rows) - min(rows) + 1, max(cols) - min(cols) + 1)
            assert shape in ((h, w), (w, h)) and len(set(block.tolist())) == h * w
            shapes.add(shape)
    assert shapes == {(h, w), (w, h)}
    with pytest.raises(ValueError, match="no context patch"):
        block_masking(keys, 7, 4, 4, (2, 2))


# ------------------------------------------------------------------------------ momentum teacher
def test_momentum_teacher_update_and_state():
    online = nn.Module()
    online.backbone, online.head = nn.Linear(3, 4), nn.Linear(4, 2)
    teacher = MomentumTeacher(backbone=online.backbone, head=online.head)
    assert not any(p.requires_grad for p in teacher.parameters())
    assert set(rank_local_state_names(teacher)) == {n for n, _ in teacher.named_parameters()}
    before = [p.clone() for p in teacher.parameters()]
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    teacher.update(online, 0.75)
    for t0, t1, o in zip(before, teacher.parameters(), online.parameters()):
        torch.testing.assert_close(t1, 0.75 * t0 + 0.25 * o)


# ------------------------------------------------------------------------------ methods
@pytest.mark.parametrize("name", VIT_METHODS)
def test_vit_methods_train_and_embed(name):
    model = _build(name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    teacher = getattr(model, "teacher", None) or getattr(model, "target", None) or getattr(model, "momentum_encoder", None)
    for step in range(2):
        loss = _step(model, name, step)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        trained = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not trained, f"parameters without gradient (DDP would fail): {trained}"
        opt.step()
        model.on_after_step(step)
    if teacher is not None:
        assert set(rank_local_state_names(teacher)) and not any(p.requires_grad for p in teacher.parameters())
    model.eval()
    assert model.embed(torch.randn(3, 3, 8, 8)).shape == (3, 16)


@pytest.mark.parametrize("name", ["mae", "ibot", "ijepa"])
def test_token_methods_need_a_vit(name):
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(ValueError, match="needs a ViT backbone"):
        _build(name, backbone=cnn)


@pytest.mark.parametrize("name", ["lejepa", "mocov3"])
def test_backbone_agnostic_methods_train_a_cnn(name):
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    assert torch.isfinite(_step(_build(name, backbone=cnn), name, 0))


@pytest.mark.parametrize("name", ["mae", "ibot", "ijepa", "lejepa"])
def test_masked_methods_refuse_a_call_without_keys(name):
    with pytest.raises(ValueError, match="keys"):
        _build(name)(_views(name))


def test_the_same_keys_give_the_same_loss_and_other_keys_another():
    model = _build("mae")
    x = _views("mae")
    keys = SampleKeys(0, 0, torch.arange(6))
    assert torch.equal(model(x, keys=keys), model(x, keys=keys))
    assert not torch.equal(model(x, keys=keys), model(x, keys=SampleKeys(0, 1, torch.arange(6))))


def test_mocov3_freezes_the_patch_projection():
    model = _build("mocov3")
    assert not any(p.requires_grad for p in model.backbone.patch_embed.parameters())
    assert all(p.requires_grad for p in _build("mocov3", freeze_patch_embed=False).backbone.patch_embed.parameters())


def test_ibot_sinkhorn_centering_and_no_koleo_train():
    model = _build("ibot", centering="sinkhorn", koleo_weight=0.0)
    assert torch.isfinite(_step(model, "ibot", 0))
    assert model.loss_fn.center.abs().sum() == 0                  # Sinkhorn mode: no centre update


@pytest.mark.parametrize(("name", "params", "match"), [
    ("mae", dict(mask_ratio=1.5), "mask_ratio"),
    ("ibot", dict(centering="mean"), "centering"),
    ("ijepa", dict(num_targets=0), "num_targets"),
    ("lejepa", dict(knots=1), "knots"),
    ("mocov3", dict(temperature=0.0), "temperature"),
])
def test_bad_params_are_config_errors(name, params, match):
    with pytest.raises(ConfigError, match=match):
        METHODS[name].Params(**params)


def test_mae_mask_count_must_leave_a_visible_patch():
    with pytest.raises(ValueError, match="one visible"):
        _step(_build("mae", mask_ratio=1.0), "mae", 0)


# ------------------------------------------------------------------------------ default backbone
def test_the_recipe_names_the_default_backbone():
    assert validate_run(TrainConfig(method="simclr")).backbone == "small_cnn"
    for name in VIT_METHODS:
        chosen = validate_run(TrainConfig(method=name)).backbone                 # embedded digits default
        assert chosen in VIT_BACKBONES and chosen == METHODS[name].recipe.for_data("digits").backbone
        assert resolve_recipe(TrainConfig(method=name, data="synthetic")).backbone == METHODS[name].recipe.backbone
    assert validate_run(TrainConfig(method="mae", backbone="vit_tiny")).backbone == "vit_tiny"     # the user's wins
    assert resolve_recipe(TrainConfig(method="mae", backbone="vit_small")).backbone == "vit_small"


# -- with real processes --

WORLD = 2


LOCAL_BATCH = 4


STEPS = 3


TOL = 1e-6


CASES: dict[str, tuple[str, dict]] = {
    "mae": ("mae", dict(decoder_dim=16, decoder_depth=1, decoder_heads=2)),
    "ibot": ("ibot", dict(hidden_dim=16, bottleneck_dim=8, out_dim=32, momentum_base=0.9,
                          teacher_temp_warmup_fraction=0.5)),
    "ibot_sinkhorn": ("ibot", dict(hidden_dim=16, bottleneck_dim=8, out_dim=32, centering="sinkhorn")),
    "ijepa": ("ijepa", dict(predictor_dim=16, predictor_depth=1, predictor_heads=2, num_targets=2,
                            momentum_base=0.9)),
    "lejepa": ("lejepa", dict(proj_hidden_dim=16, proj_dim=8, num_slices=16)),
    "mocov3": ("mocov3", dict(proj_hidden_dim=16, proj_dim=8, pred_hidden_dim=16, momentum_base=0.9)),
}


GLOBAL_INDICES = torch.tensor([31, 4, 17, 99, 2, 56, 8, 1000])


def _specs(world: int) -> dict[str, dict]:
    from unison.equivalence import CheckSpec

    out = {}
    for key, (method, params) in CASES.items():
        d = dataclasses.asdict(CheckSpec(method=method, world_size=WORLD, steps=STEPS, local_batch=LOCAL_BATCH,
                                         image_size=16, backbone="vit_micro_p4", method_params=params))
        if world == 1:
            d.update(world_size=1, local_batch=LOCAL_BATCH * WORLD)
        out[key] = d
    return out


def _masks() -> dict[str, torch.Tensor]:
    from unison.distributed import collectives as C
    from unison.methods import SampleKeys
    from unison.methods.masking import block_masking, random_masking

    keys = SampleKeys(seed=5, epoch=1, indices=GLOBAL_INDICES[C.local_slice(len(GLOBAL_INDICES))])
    return {"random": random_masking(keys, 3, 64, 40)[1], "blocks": block_masking(keys, 9, 8, 4, (3, 3))[0]}


def _loss_gradients() -> dict[str, torch.Tensor]:
    """d(loss)/d(theta) for z = X @ theta as DDP computes it: each rank's gradient, averaged over ranks."""
    from unison.distributed import collectives as C
    from unison.losses import KoLeoLoss, LeJEPALoss, sigreg_directions

    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)[C.local_slice(12)]
    a = sigreg_directions(0, 0, 4, 6, dtype=torch.float64)
    losses = {"sigreg": lambda z: LeJEPALoss(lambd=1.0)(z[None], n_global=1, directions=a), "koleo": KoLeoLoss()}
    out = {}
    for name, loss_fn in losses.items():
        theta = torch.randn(5, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64, requires_grad=True)
        loss_fn(x @ theta).backward()
        out[name] = C.all_reduce_no_grad(theta.grad, average=True)
    return out


def _distributed_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    out = {key: record_steps(spec) for key, spec in specs.items()}
    out["_masks"], out["_grads"] = _masks(), _loss_gradients()
    return out


def _reference_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    out = {key: record_steps(spec) for key, spec in specs.items()}
    out["_masks"], out["_grads"] = _masks(), _loss_gradients()
    return out


@pytest.fixture(scope="module")
def runs():
    multi = run_in_workers(_distributed_worker, WORLD, args=(_specs(WORLD),), timeout_s=600)
    single = run_in_workers(_reference_worker, 1, args=(_specs(1),), backend="local")[0]
    return multi, single


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_equal_one_process(runs, case):
    multi, single = runs
    for r in range(WORLD):
        m, s = multi[r][case], single[case]
        assert len(m["losses"]) == len(s["losses"]) == STEPS
        for step in range(STEPS):
            ml, sl = float(m["losses"][step]), float(s["losses"][step])
            assert abs(ml - sl) <= TOL * abs(sl), f"step {step}: loss {ml} vs {sl}"
            d, k = max_rel_difference(m["grads"][step], s["grads"][step])
            assert d < TOL, f"rank {r} step {step}: gradient of {k} differs by {d:.2e}"
            d, k = max_rel_difference(m["states"][step], s["states"][step])
            assert d < TOL, f"rank {r} step {step}: state {k} differs by {d:.2e}"
    assert multi[0][case]["identical"], "the state differs between ranks"
    assert multi[0][case]["note"] is None


@pytest.mark.distributed
@pytest.mark.slow
def test_teachers_and_centres_moved(runs):
    _, single = runs
    first, last = single["ibot"]["states"][0], single["ibot"]["states"][-1]
    assert last["loss_fn.center"].abs().sum() > 0 and last["loss_fn.patch_center"].abs().sum() > 0
    assert not torch.equal(first["teacher.head.last_layer.weight"], last["teacher.head.last_layer.weight"])
    assert int(single["lejepa"]["states"][-1]["step_count"]) == STEPS


@pytest.mark.distributed
@pytest.mark.slow
def test_masks_are_the_same_at_one_and_two_workers(runs):
    multi, single = runs
    for kind in ("random", "blocks"):
        gathered = torch.cat([multi[r]["_masks"][kind] for r in range(WORLD)])
        assert torch.equal(gathered, single["_masks"][kind]), kind


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigreg", "koleo"])
def test_global_batch_regularisers_have_exact_gradients(runs, loss):
    multi, single = runs
    for r in range(WORLD):
        torch.testing.assert_close(multi[r]["_grads"][loss], single["_grads"][loss], rtol=1e-10, atol=1e-12)
