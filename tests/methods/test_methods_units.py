"""Single-process checks of the methods: registry, recipes, schedules, queues, checkpoints, errors."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn as nn

from unison.data.augment import PRESETS
from unison.distributed.tagging import rank_local_state_names
from unison.methods import (
    BYOL,
    DINO,
    METHODS,
    BarlowTwins,
    BYOLParams,
    DINOParams,
    MoCo,
    MoCoParams,
    SwAV,
    SwAVParams,
    VICReg,
)
from unison.methods.dino import DINOHead
from unison.optim import OPTIMIZER_NAMES

SMALL = {
    "moco": dict(proj_hidden_dim=8, proj_dim=4, queue_size=32),
    "byol": dict(proj_hidden_dim=8, proj_dim=4, pred_hidden_dim=8),
    "simsiam": dict(proj_hidden_dim=8, proj_dim=8, pred_hidden_dim=2),
    "barlowtwins": dict(proj_hidden_dim=8, proj_dim=4),
    "swav": dict(proj_hidden_dim=8, proj_dim=4, n_prototypes=6, queue_length=16),
    "vicreg": dict(proj_hidden_dim=8, proj_dim=4),
    "dino": dict(hidden_dim=8, bottleneck_dim=4, out_dim=16),
}


MULTICROP = {"swav", "dino"}


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _build(name: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    cls = METHODS[name]
    params = cls.Params(**{**SMALL[name], **kw.pop("params", {})})
    return cls(_backbone(), 4, params, steps_total=kw.pop("steps_total", 10), **kw)


def _views(name: str, n: int = 8, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    views = [torch.randn(n, 3, 8, 8, generator=g) for _ in range(2)]
    if name in MULTICROP:
        views += [torch.randn(n, 3, 4, 4, generator=g) for _ in range(2)]
    return views


def _train(model: nn.Module, name: str, steps: int = 2, n: int = 8) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(steps):
        loss = model(_views(name, n, step))
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.on_after_step(step)


def test_registry_params_and_recipes():
    assert {"moco", "byol", "simsiam", "barlowtwins", "swav", "vicreg", "dino", "simclr"} <= set(METHODS)
    for name, cls in METHODS.items():
        assert cls.name == name
        cls.Params()                                       # published defaults construct
        assert cls.recipe.optimizer in OPTIMIZER_NAMES
        assert cls.recipe.augmentation in PRESETS
        assert cls.recipe.base_lr > 0 and cls.recipe.weight_decay >= 0
        doc = sys.modules[cls.__module__].__doc__ or ""
        assert "Example::" in doc and "istributed" in doc, f"{name}: module docstring lacks semantics or example"
    assert METHODS["swav"].recipe.augmentation == METHODS["dino"].recipe.augmentation == "multicrop"


@pytest.mark.parametrize("name", list(SMALL))
def test_train_steps_and_default_dims(name):
    model = _build(name)
    _train(model, name)
    model.eval()
    assert model.embed(_views(name)[0]).shape == (8, 4)
    cls = METHODS[name]
    big = cls(_backbone(), 4, cls.Params(), steps_total=4)     # the published (CPU-reduced) defaults run too
    loss = big(_views(name, n=8))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", ["moco", "byol", "simsiam", "barlowtwins", "vicreg"])
def test_two_view_methods_refuse_multicrop(name):
    with pytest.raises(ValueError, match="exactly 2 views"):
        _build(name)(_views("swav"))


@pytest.mark.parametrize("name", ["swav", "dino"])
def test_multicrop_methods_need_two_global_views(name):
    with pytest.raises(ValueError, match="at least 2 global views"):
        _build(name)(_views(name)[:1])


# ------------------------------------------------------------------------------ MoCo
def test_moco_queue_and_pointer_survive_a_state_dict_round_trip():
    model = _build("moco")
    _train(model, "moco", steps=3)
    state = model.state_dict()
    assert {"queue", "queue_ptr", "step_count"} <= set(state)
    assert any(k.startswith("key_encoder.backbone.") for k in state)
    assert int(state["queue_ptr"]) == (3 * 2 * 8) % 32
    fresh = _build("moco", seed=1)
    assert not torch.equal(fresh.queue, model.queue)
    fresh.load_state_dict(state)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0)


def test_moco_rank_local_state():
    names = rank_local_state_names(_build("moco"))
    assert {"queue", "queue_ptr", "step_count"} <= set(names)
    assert any(n.startswith("key_encoder.backbone.") for n in names) and any(n.startswith("key_encoder.projector.") for n in names)
    assert not any(n.startswith(("backbone.", "projector.")) for n in names)


def test_moco_enqueues_the_keys_of_both_views_in_order():
    model = _build("moco", params=dict(queue_size=32))
    a, b = _views("moco")
    model([a, b])
    with torch.no_grad():
        keys = [nn.functional.normalize(model.key_encoder.projector(model.key_encoder.backbone(v)), dim=1) for v in (a, b)]
    torch.testing.assert_close(model.queue[:16], torch.cat(keys))
    assert int(model.queue_ptr) == 16
    asym = _build("moco", params=dict(queue_size=32, symmetric=False))
    asym([a, b])
    assert int(asym.queue_ptr) == 8


def test_moco_queue_size_error():
    model = _build("moco", params=dict(queue_size=20))
    with pytest.raises(ValueError, match=r"queue_size=20 is not a multiple of the 16 keys") as e:
        model(_views("moco"))
    assert "queue_size=16" in str(e.value) and "\n" not in str(e.value)
    _build("moco", params=dict(queue_size=16))(_views("moco"))      # one process, batch 8: 16 keys per step


def test_moco_key_encoder_follows_the_ema():
    model = _build("moco", params=dict(momentum=0.5))
    before = [p.clone() for p in model.key_encoder.backbone.parameters()]
    _train(model, "moco", steps=1)
    for k0, k1, q in zip(before, model.key_encoder.backbone.parameters(), model.backbone.parameters()):
        torch.testing.assert_close(k1, 0.5 * k0 + 0.5 * q)
    assert not any(p.requires_grad for p in model.key_encoder.backbone.parameters())


def test_exactness_notes():
    assert _build("moco").exactness_note() is None
    assert "own queue" in _build("moco", shared_queue=False).exactness_note()
    assert "shuffle_bn" in _build("moco", params=dict(shuffle_bn=True)).exactness_note()
    assert _build("byol", gather_distributed=False).exactness_note() is None
    assert _build("simsiam", gather_distributed=False).exactness_note() is None
    for name in ("barlowtwins", "vicreg", "swav", "dino"):
        assert _build(name).exactness_note() is None
        assert "gather is off" in _build(name, gather_distributed=False).exactness_note()
    assert "resumed" in _build("swav", shared_queue=False).exactness_note()


# ------------------------------------------------------------------------------ schedules
def test_byol_and_dino_schedules():
    byol = _build("byol", params=dict(momentum_base=0.99), steps_total=100)
    assert byol.momentum(0) == pytest.approx(0.99)
    assert byol.momentum(50) == pytest.approx(1 - 0.01 * 0.5)
    assert byol.momentum(100) == pytest.approx(1.0)
    dino = _build("dino", params=dict(teacher_temp_warmup_fraction=0.2), steps_total=100)
    assert dino.momentum(0) == pytest.approx(0.996) and dino.momentum(100) == pytest.approx(1.0)
    assert dino.teacher_temp(0) == pytest.approx(0.04)
    assert dino.teacher_temp(10) == pytest.approx(0.055)
    assert dino.teacher_temp(20) == dino.teacher_temp(99) == pytest.approx(0.07)


def test_byol_target_uses_the_scheduled_momentum():
    model = _build("byol", params=dict(momentum_base=0.9), steps_total=4)
    before = [p.clone() for p in model.target.projector.parameters()]
    _train(model, "byol", steps=1)
    tau = 1 - 0.1 * (math.cos(0) + 1) / 2
    for t0, t1, o in zip(before, model.target.projector.parameters(), model.projector.parameters()):
        torch.testing.assert_close(t1, tau * t0 + (1 - tau) * o)


def test_dino_teacher_centre_and_head():
    model = _build("dino")
    _train(model, "dino", steps=2)
    assert model.loss_fn.center.abs().sum() > 0
    assert "loss_fn.center" in model.state_dict() and "loss_fn.center" in rank_local_state_names(model)
    head = DINOHead(4, 16, hidden_dim=8, bottleneck_dim=4, num_layers=3)
    x = torch.randn(5, 4)
    w = nn.functional.normalize(head.last_layer.weight, dim=1)
    torch.testing.assert_close(head(x), nn.functional.normalize(head.mlp(x), dim=-1) @ w.T)
    assert head(x).abs().max() <= 1 + 1e-6                         # unit rows x unit input


# ------------------------------------------------------------------------------ SwAV
def test_swav_prototypes_normalised_and_frozen():
    model = _build("swav", params=dict(freeze_prototypes_steps=2, queue_length=0))
    with torch.no_grad():
        model.prototypes.weight.mul_(3.0)                                    # forward re-normalises
    frozen = nn.functional.normalize(model.prototypes.weight, dim=1).clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        opt.zero_grad()
        model(_views("swav", step=step)).backward()
        if step < 2:
            assert model.prototypes.weight.grad.abs().max() == 0           # zero gradient while frozen
        opt.step()
        model.on_after_step(step)
        if step < 2:
            torch.testing.assert_close(model.prototypes.weight, frozen)      # restored after the step
    assert not torch.allclose(model.prototypes.weight, frozen)               # trained after the freeze
    model(_views("swav"))
    torch.testing.assert_close(model.prototypes.weight.norm(dim=1), torch.ones(6))


def test_swav_queue_fills_then_is_used():
    model = _build("swav", params=dict(queue_length=16))
    calls = []
    original = model.loss_fn.forward
    model.loss_fn.forward = lambda scores, queue_scores=None: calls.append(queue_scores is not None) or original(
        scores, queue_scores)
    _train(model, "swav", steps=3)
    assert calls == [False, False, True]          # 8 rows per step, full (16) after two steps
    assert int(model.queue_filled) == 16
    with pytest.raises(ValueError, match="queue_length=12 is not a multiple of the global batch 8"):
        _build("swav", params=dict(queue_length=12))(_views("swav"))


def test_swav_and_dino_run_each_resolution_separately():
    model = _build("dino")
    seen = []
    model.backbone.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    model(_views("dino"))
    assert seen == [(16, 3, 8, 8), (16, 3, 4, 4)]


def test_barlow_and_vicreg_build_three_layer_projectors():
    for cls in (BarlowTwins, VICReg):
        m = cls(_backbone(), 4, cls.Params(proj_hidden_dim=8, proj_dim=6))
        linears = [x for x in m.projector if isinstance(x, nn.Linear)]
        assert len(linears) == 3 and linears[-1].bias is None and linears[-1].out_features == 6


def test_defaults_are_the_documented_ones():
    assert (MoCoParams().temperature, MoCoParams().queue_size, MoCoParams().momentum) == (0.1, 4096, 0.99)
    assert BYOLParams().momentum_base == 0.99
    p = SwAVParams()
    assert (p.temperature, p.sinkhorn_epsilon, p.sinkhorn_iterations) == (0.1, 0.05, 3)
    d = DINOParams()
    assert (d.student_temp, d.warmup_teacher_temp, d.teacher_temp, d.center_momentum, d.momentum_base) == (
        0.1, 0.04, 0.07, 0.9, 0.996)
    assert isinstance(_build("swav"), SwAV) and isinstance(_build("dino"), DINO) and isinstance(_build("byol"), BYOL)
    assert isinstance(_build("moco"), MoCo)


def test_recipe_for_embedded_digits():
    from unison.methods import METHODS

    assert METHODS["simclr"].recipe.for_data("digits").augmentation == "digits"
    assert METHODS["swav"].recipe.for_data("digits").augmentation == "digits_multicrop"
    barlow = METHODS["barlowtwins"].recipe
    assert (barlow.for_data("digits").optimizer, barlow.for_data("digits").base_lr) == ("lars", 0.3)
    assert barlow.for_data("../shared/data/cifar10/train") is barlow
    byol = METHODS["byol"].recipe.for_data("digits")
    assert (byol.optimizer, byol.base_lr, byol.weight_decay) == ("adam", 2e-3, 1e-6)
    assert METHODS["byol"].recipe.for_data("../shared/data/cifar10/train").optimizer == "sgd"
