"""NNCLR's support set: what it enqueues and when, its pointer, checkpoints, its size check, its views; the FIFO
against Lightly's `NNMemoryBankModule` (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.tagging import rank_local_state_names
from unison.errors import ConfigError
from unison.losses import nearest_neighbours
from unison.methods import NNCLR, NNCLRParams

SMALL = dict(proj_hidden_dim=8, proj_dim=4, pred_hidden_dim=8, queue_size=16)


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _model(**params) -> NNCLR:
    torch.manual_seed(0)
    return NNCLR(_backbone(), 4, NNCLRParams(**{**SMALL, **params}))


def _views(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 8, 8, generator=g) for _ in range(2)]


def test_the_first_views_normalised_projections_are_enqueued_after_the_lookups():
    model = _model()
    views = _views()
    before = model.queue.clone()
    loss = model(views)
    with torch.no_grad():   # train mode: batch norm normalises with this batch's statistics, as the forward did
        z_a, z_b = (model.projector(model.backbone(v)) for v in views)
        expected = 0.5 * (model.loss_fn(nearest_neighbours(z_a, before), model.predictor(z_b))
                          + model.loss_fn(nearest_neighbours(z_b, before), model.predictor(z_a)))
    torch.testing.assert_close(loss.detach(), expected)   # looked up in the queue as it was before the step
    torch.testing.assert_close(model.queue[:4], F.normalize(z_a, dim=1))
    assert torch.equal(model.queue[4:], before[4:]) and int(model.queue_ptr) == 4


def test_the_pointer_wraps_and_eval_forwards_leave_the_queue_alone():
    model = _model()
    for step in range(4):
        model(_views(seed=step))
    assert int(model.queue_ptr) == 0            # 4 steps x 4 samples = the 16 entries
    queue = model.queue.clone()
    model.eval()
    model(_views(seed=9))
    assert torch.equal(model.queue, queue) and int(model.queue_ptr) == 0


def test_the_queue_follows_lightlys_memory_bank_fifo():
    modules = pytest.importorskip("lightly.models.modules")
    model = _model()
    bank = modules.NNMemoryBankModule(size=(16, 4))
    bank.bank.copy_(model.queue)
    for step in range(6):
        z = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        model._enqueue(F.normalize(z, dim=1))
        bank(F.normalize(z, dim=1), update=True)
        torch.testing.assert_close(model.queue, bank.bank, rtol=0, atol=0)


def test_queue_survives_a_state_dict_round_trip_and_is_rank_local():
    model = _model()
    for step in range(3):
        model(_views(seed=step))
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.queue, model.queue) and int(fresh.queue_ptr) == 12
    assert {"queue", "queue_ptr"} <= set(rank_local_state_names(model))


def test_gradients_reach_the_encoder_through_the_predictions():
    model = _model()
    model(_views()).backward()
    assert all(p.grad is not None for p in model.predictor.parameters())
    assert model.backbone[0].weight.grad.abs().sum() > 0


def test_queue_size_must_hold_whole_global_batches():
    with pytest.raises(ConfigError, match=r"queue_size=100 is not a multiple of the global batch 8 = 4 per rank x 2 "
                                          r"ranks.*use queue_size=96"):
        NNCLR.check_run(NNCLRParams(queue_size=100), global_batch=8, world_size=2, shared_queue=True)
    with pytest.raises(ConfigError, match="local batch 4 .per-rank queue"):
        NNCLR.check_run(NNCLRParams(queue_size=10), global_batch=8, world_size=2, shared_queue=False)
    NNCLR.check_run(NNCLRParams(queue_size=96), global_batch=8, world_size=2, shared_queue=True)
    with pytest.raises(ConfigError, match="not a multiple"):
        _model(queue_size=10)(_views())


def test_views_must_be_two_of_one_size():
    NNCLR.check_views(NNCLRParams(), None, [32, 32])
    with pytest.raises(ConfigError, match=r"NNCLR takes exactly 2 views of one size; the augmentation makes 6 "
                                          r"\(32, 32, 14, 14, 14, 14 px\)"):
        NNCLR.check_views(NNCLRParams(), None, [32, 32, 14, 14, 14, 14])


def test_per_rank_queues_are_named_inexact():
    model = NNCLR(_backbone(), 4, NNCLRParams(**SMALL), shared_queue=False)
    assert "own support set" in (model.exactness_note() or "")
    assert _model().exactness_note() is None
