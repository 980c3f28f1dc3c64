"""DenseCL, the method (one process): its two queues (what goes in, in which order, their length check, their
checkpoint), its key encoder, its lambda warm-up, its backbones, and what `unison check` reports of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unison.distributed.tagging import rank_local_state_names
from unison.errors import ConfigError
from unison.methods import DenseCL, DenseCLParams
from unison.models import build_backbone
from unison.models.dense import coarse_grid, dense_features

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(proj_hidden_dim=16, proj_dim=8, queue_size=48)


def _model(backbone: str = "small_cnn", seed: int = 0, **params) -> DenseCL:
    torch.manual_seed(seed)
    net, dim = build_backbone(backbone, 16)
    return DenseCL(net, dim, DenseCLParams(**{**SMALL, **params}))


def _views(n: int = 8, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, 3, 16, 16, generator=g) for _ in range(2)]


def _train(model: DenseCL, steps: int = 2) -> None:
    for step in range(steps):   # plain SGD steps (torch.optim's first use imports torch._dynamo: seconds)
        loss = model(_views(step=step))
        assert torch.isfinite(loss)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
        model.on_after_step(step)


def _keys(model: DenseCL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised global key, normalised mean dense key) of `x`, computed here from the key encoder's parts."""
    k = model.key_encoder
    with torch.no_grad():
        pooled, grid = dense_features(k.backbone, x, model.feature_dim)
        cells = coarse_grid(grid, model.params.grid_size)[0].flatten(1, 2)
        return F.normalize(k.projector(pooled), dim=1), F.normalize(k.dense_projector(cells).mean(dim=1), dim=1)


@pytest.mark.parametrize("backbone", ["small_cnn", "vit_micro_auto"])
def test_densecl_trains_on_any_backbone_with_a_feature_map(backbone):
    model = _model(backbone)
    _train(model)
    model.eval()
    assert model.embed(_views()[0]).shape == (8, model.feature_dim)


def test_densecl_enqueues_each_views_global_and_pooled_dense_keys_in_order():
    a, b = _views()
    asym = _model()
    asym([a, b])                                  # the official code: view 0 queries, view 1 keys
    k, dense = _keys(asym, b)
    torch.testing.assert_close(asym.queue[:8], k)
    torch.testing.assert_close(asym.dense_queue[:8], dense)
    assert int(asym.queue_ptr) == 8
    sym = _model(symmetric=True)
    sym([a, b])
    keys = [_keys(sym, v) for v in (a, b)]
    torch.testing.assert_close(sym.queue[:16], torch.cat([keys[0][0], keys[1][0]]))
    torch.testing.assert_close(sym.dense_queue[:16], torch.cat([keys[0][1], keys[1][1]]))
    assert int(sym.queue_ptr) == 16


def _expected_loss(model: DenseCL, a: torch.Tensor, b: torch.Tensor, queue: torch.Tensor, dense_queue: torch.Tensor,
                   lam: float | None = None) -> torch.Tensor:
    """`DenseCLLoss` of query view `a` and key view `b` against the given queues, from the model's parts."""
    q, q_dense, q_cells = model._encode(model.backbone, model.projector, model.dense_projector, a)
    with torch.no_grad():
        pooled, grid = dense_features(model.key_encoder.backbone, b, model.feature_dim)
        k_cells = coarse_grid(grid, model.params.grid_size)[0].flatten(1, 2)
        k, k_dense = model.key_encoder.projector(pooled), model.key_encoder.dense_projector(k_cells)
    return model.loss_fn(q, k, queue, q_dense, k_dense, q_cells, k_cells, dense_queue, lam)


def test_densecl_scores_against_the_queues_as_they_were_before_the_step():
    model = _model()
    a, b = _views()
    queue, dense_queue = model.queue.clone(), model.dense_queue.clone()
    loss = model([a, b])
    assert not torch.equal(model.queue, queue)
    torch.testing.assert_close(loss, _expected_loss(model, a, b, queue, dense_queue))


def test_densecl_queue_length_must_hold_whole_steps_of_keys():
    with pytest.raises(ConfigError, match=r"queue_size=20 is not a multiple of the 8 keys") as e:
        _model(queue_size=20)(_views())
    assert "use queue_size=16" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="16 keys enqueued per step .2 view.s. x global batch 8 = 4 per rank x 2"):
        DenseCL.check_run(DenseCLParams(queue_size=40, symmetric=True), global_batch=8, world_size=2,
                          shared_queue=True)
    DenseCL.check_run(DenseCLParams(queue_size=40), global_batch=8, world_size=2, shared_queue=True)


def test_densecl_state_is_rank_local_and_checkpointed():
    model = _model()
    _train(model, steps=3)
    names = set(rank_local_state_names(model))
    assert {"queue", "dense_queue", "queue_ptr", "step_count"} <= names
    assert any(n.startswith("key_encoder.dense_projector.") for n in names)
    assert not any(n.startswith(("backbone.", "projector.", "dense_projector.")) for n in names)
    state = model.state_dict()
    assert int(state["queue_ptr"]) == 3 * 8 % 48 and int(state["step_count"]) == 3
    fresh = _model(seed=1)
    fresh.load_state_dict(state)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)


def test_densecl_key_encoder_follows_the_ema_of_all_three_parts():
    model = _model(momentum=0.5)
    online = [model.backbone, model.projector, model.dense_projector]
    keys = [model.key_encoder.backbone, model.key_encoder.projector, model.key_encoder.dense_projector]
    before = [[p.clone() for p in k.parameters()] for k in keys]
    _train(model, steps=1)
    for was, key, net in zip(before, keys, online):
        for k0, k1, q in zip(was, key.parameters(), net.parameters()):
            torch.testing.assert_close(k1, 0.5 * k0 + 0.5 * q)
        assert not any(p.requires_grad for p in key.parameters())


def test_densecl_warm_up_trains_the_global_term_alone_first():
    model = _model(lambda_warmup_steps=1, loss_lambda=0.7)
    a, b = _views()
    for step, lam in ((0, 0.0), (1, 0.7)):   # lambda 0 during the warm-up's steps, then the given one
        model.step_count.fill_(step)
        queue, dense_queue = model.queue.clone(), model.dense_queue.clone()
        loss = model([a, b])
        torch.testing.assert_close(loss, _expected_loss(model, a, b, queue, dense_queue, lam))
        assert not torch.allclose(loss, _expected_loss(model, a, b, queue, dense_queue, 0.7 - lam))


def test_densecl_exactness_notes():
    assert _model().exactness_note() is None
    assert DenseCL.inexact_reason is None
    net, dim = build_backbone("small_cnn", 16)
    assert "own queues" in DenseCL(net, dim, DenseCLParams(**SMALL), shared_queue=False).exactness_note()
    assert "shuffle_bn" in _model(shuffle_bn=True).exactness_note()
