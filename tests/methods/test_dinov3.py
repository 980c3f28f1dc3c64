"""DINOv3, in one process: Gram anchoring's schedule (DINOv3's iterations as fractions of the run), the Gram
teacher (a snapshot of the EMA teacher, loaded and refreshed on schedule, rank-local and in the checkpoint so that
a resumed run continues exactly), the loss it adds, DINOv3's other defaults and the one-line refusals. Its W=2
exactness, --shard full and exact accumulation included, is `unison check` (tests/helpers/every_method.py)."""

from __future__ import annotations

import pytest
import torch

from unison.distributed.tagging import rank_local_state_names
from unison.errors import ConfigError
from unison.losses import GramAnchoringLoss
from unison.methods import METHODS, SampleKeys
from unison.methods.dinov2 import DINOv2
from unison.methods.dinov3 import DINOv3, DINOv3Params
from unison.models.vit import ViT

SMALL = dict(hidden_dim=16, bottleneck_dim=8, out_dim=32)


def _build(steps_total: int = 12, **params) -> DINOv3:
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    return DINOv3(vit, 16, DINOv3Params(**{**SMALL, **params}), steps_total=steps_total).double()


def _batch(step: int, n: int = 4) -> tuple[list[torch.Tensor], SampleKeys]:
    g = torch.Generator().manual_seed(step)
    views = [torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)] + \
        [torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    return views, SampleKeys(seed=0, epoch=0, indices=torch.arange(n) + 10 * step)


def _train(model: DINOv3, steps: range, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        views, keys = _batch(step)
        optimizer.zero_grad()
        loss = model(views, keys=keys)
        loss.backward()
        optimizer.step()
        model.on_after_step(step)
        losses.append(loss.detach())
    return losses


def _sgd(model: DINOv3) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_schedule_is_dinov3s_iterations_as_fractions_of_the_run():
    """dinov3_vit7b16_gram_anchor.yaml, in thousands of iterations: anchoring from 1000 of 1200, the Gram teacher
    loaded there and refreshed every 10 from 1010, at most 3 times."""
    model = _build(steps_total=1200)
    assert model.gram_start() == 1000
    due = {step: model.gram_loads_due(step) for step in (0, 999, 1000, 1009, 1010, 1019, 1020, 1030, 1040, 1199)}
    assert due == {0: 0, 999: 0, 1000: 1, 1009: 1, 1010: 2, 1019: 2, 1020: 3, 1030: 4, 1040: 4, 1199: 4}
    # the start is rounded down: a check's few steps anchor their last ones
    assert [_build(steps_total=t).gram_start() for t in (1, 2, 4, 6)] == [0, 1, 3, 5]
    assert _build(steps_total=4, gram_start_fraction=1.0).gram_loads_due(3) == 0


def test_the_gram_teacher_is_the_ema_teacher_of_the_start_refreshed_on_schedule():
    model = _build()                                        # 12 steps: start 10, refreshed every step (at most 3)
    initial = [p.clone() for p in model.gram_teacher.parameters()]
    optimizer = _sgd(model)
    _train(model, range(10), optimizer)
    assert int(model.gram_loads) == 0 and all(torch.equal(p, q) for p, q in zip(model.gram_teacher.parameters(), initial))
    teacher_before_step_10 = {k: v.clone() for k, v in model.teacher.backbone.state_dict().items()}
    views, keys = _batch(10)
    loss = model(views, keys=keys)                          # step 10's forward: loaded first
    assert int(model.gram_loads) == 1
    assert all(torch.equal(v, teacher_before_step_10[k]) for k, v in model.gram_teacher.backbone.state_dict().items())
    assert not all(torch.equal(p, q) for p, q in zip(model.gram_teacher.parameters(), initial))
    out = model.distill(views, keys, 10)                    # the same forward without the Gram term
    with torch.no_grad():
        anchor = model.gram_teacher.backbone.forward_tokens(out.global_crops)[:, 1:]
    term = GramAnchoringLoss()(out.student_tokens[:, 1:], anchor)
    assert float(term.detach()) > 0
    torch.testing.assert_close(loss, out.loss + 2.0 * term, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None and not p.requires_grad for p in model.gram_teacher.parameters())


def test_before_the_start_it_is_dinov2_with_dinov3s_defaults():
    model = _build(steps_total=1200)
    views, keys = _batch(0)
    assert isinstance(model, DINOv2) and model.params.separate_head and hasattr(model, "ibot_head")
    torch.testing.assert_close(model(views, keys=keys), model.distill(views, keys, 0).loss, rtol=0, atol=0)
    assert model.momentum(0) == model.momentum(600) == model.momentum(1200) == 0.994        # constant
    assert model.teacher_temp(0) == pytest.approx(0.04) and model.teacher_temp(120) == pytest.approx(0.07)


def test_the_gram_teacher_is_rank_local_and_a_resumed_run_continues_exactly():
    names = rank_local_state_names(_build())
    assert "gram_loads" in names and any(n.startswith("gram_teacher.backbone.") for n in names)
    straight = _build(gram_refresh_fraction=1 / 6)         # loaded at 10, refreshed every 2 steps: not at 11
    optimizer = _sgd(straight)
    _train(straight, range(11), optimizer)
    checkpoint = {k: v.clone() for k, v in straight.state_dict().items()}
    assert {"gram_loads", "gram_teacher.backbone.pos_embed"} <= set(checkpoint)
    moments = {k: v for k, v in optimizer.state_dict().items()}
    expected = _train(straight, range(11, 12), optimizer)

    resumed = _build(gram_refresh_fraction=1 / 6)
    resumed.load_state_dict(checkpoint)
    optimizer = _sgd(resumed)
    optimizer.load_state_dict(moments)
    assert torch.equal(_train(resumed, range(11, 12), optimizer)[0], expected[0])
    assert _same(resumed, straight) and int(resumed.gram_loads) == 1

    forgetful = _build(gram_refresh_fraction=1 / 6)         # the same checkpoint without its Gram teacher
    forgetful.load_state_dict({k: v for k, v in checkpoint.items() if not k.startswith("gram_teacher.")},
                              strict=False)
    assert not torch.equal(_train(forgetful, range(11, 12), _sgd(forgetful))[0], expected[0])


def test_registered_and_bad_parameters_are_one_line():
    assert METHODS["dinov3"] is DINOv3 and DINOv3.recipe == DINOv2.recipe
    p = DINOv3Params()
    assert (p.gram_weight, p.gram_start_fraction, p.gram_refresh_fraction, p.gram_refreshes) == (2.0, 5 / 6, 1 / 120, 3)
    assert (p.separate_head, p.momentum_base, p.teacher_temp_warmup_fraction, p.centering) == (True, 0.994, 0.1,
                                                                                                "sinkhorn")
    with pytest.raises(ConfigError, match="DINOv3 parameter gram_start_fraction=1.5"):
        DINOv3Params(gram_start_fraction=1.5)
    with pytest.raises(ConfigError, match="DINOv3 parameter gram_refreshes=-1"):
        DINOv3Params(gram_refreshes=-1)
    with pytest.raises(ConfigError, match="DINOv3 parameter gram_weight=-1"):
        DINOv3Params(gram_weight=-1.0)
    with pytest.raises(ConfigError, match="trains nothing|all 0|every"):
        DINOv3Params(cls_weight=0.0, patch_weight=0.0, koleo_weight=0.0, gram_start_fraction=1.0)
    DINOv3Params(cls_weight=0.0, patch_weight=0.0, koleo_weight=0.0)       # Gram anchoring alone trains
