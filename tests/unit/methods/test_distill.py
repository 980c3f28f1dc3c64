"""The distill method in one process: LightlyTrain's losses, the frozen teacher, mixup's world-size invariance, the
queue, and the dense features of each backbone kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.methods import Distill, DistillParams
from unison.methods.base import SampleKeys
from unison.methods.distill import _kl, auto_queue_size
from unison.models import build_backbone
from unison.models.dense import dense_features, make_dense


def _model(loss: str = "kl", teacher: str = "small_cnn", queue: int = 16, **kw) -> Distill:
    torch.manual_seed(0)
    student, dim = build_backbone("small_cnn")
    t, tdim = build_backbone(teacher, 16)
    return Distill(student, dim, DistillParams(loss=loss, queue_size=queue, **kw), teacher=t, teacher_dim=tdim)


def _keys(n: int, offset: int = 0) -> SampleKeys:
    return SampleKeys(seed=0, epoch=0, indices=torch.arange(offset, offset + n))


def test_kl_is_lightly_trains_batchmean_kl_divergence():
    s, t = torch.randn(6, 5, 9), torch.randn(6, 5, 9)
    theirs = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s.flatten(0, 1), -1), F.softmax(t.flatten(0, 1), -1))
    torch.testing.assert_close(_kl(s, t), theirs)


@pytest.mark.parametrize("loss", ["kl", "mse"])
def test_only_the_student_learns_and_the_teacher_stays_frozen_in_eval_mode(loss):
    model = _model(loss).train()
    assert not model.teacher.training and all(not p.requires_grad for p in model.teacher.parameters())
    x = torch.randn(8, 3, 16, 16)
    before = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    model([x], keys=_keys(8)).backward()
    assert all(p.grad is None for p in model.teacher.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert (model.head_global is None) == (loss == "mse")
    assert all(torch.equal(v, model.teacher.state_dict()[k]) for k, v in before.items())   # BN stats too
    assert model.embed(x).shape == (8, model.feature_dim)


def test_the_queue_holds_the_newest_teacher_embeddings_first():
    model = _model(queue=12, mixup=False)
    a, b = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    model([a])
    model([b])
    t_a = F.normalize(model._teacher(a)[0], dim=-1)
    t_b = F.normalize(model._teacher(b)[0], dim=-1)
    torch.testing.assert_close(model.queue, torch.cat([t_b, t_a[:4]]))


def test_mixup_of_a_sample_does_not_depend_on_its_place_in_the_batch():
    """Partners and lam come from (seed, epoch, index): the same in any order, hence on any number of ranks."""
    model = _model()
    x = torch.randn(10, 3, 16, 16)
    keys = _keys(10, offset=100)
    mixed = model._mixup(x, keys)
    perm = torch.randperm(10)
    again = model._mixup(x[perm], SampleKeys(0, 0, keys.indices[perm]))
    torch.testing.assert_close(again, mixed[perm])
    assert not torch.allclose(mixed, x)


@pytest.mark.parametrize("name", ["small_cnn", "resnet18_cifar", "vit_nano_p2"])
def test_dense_features_pool_to_the_backbones_own_feature(name):
    torch.manual_seed(0)
    net, dim = build_backbone(name, 16)
    net.eval()
    x = torch.randn(2, 3, 16, 16)
    pooled = net(x)
    dense, grid = dense_features(make_dense(net), x, dim)
    torch.testing.assert_close(dense, pooled)
    assert grid.shape[0] == 2 and grid.shape[-1] == dim and grid.shape[1] == grid.shape[2]


def test_the_automatic_queue_follows_lightly_trains_buckets():
    assert [auto_queue_size(n) for n in (10, 1_280, 1_999, 2_000, 50_000, None)] == [16, 512, 512, 1024, 8192, 8192]
    assert _model(queue=0).queue.shape[0] == 8192 and _model(queue=7).queue.shape[0] == 7
