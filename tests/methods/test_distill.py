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
from unison.methods.distillation import DINOHead
from unison.models import build_backbone
from unison.models.dense import dense_features, make_dense


def _model(loss: str = "kl", teacher: str = "small_cnn", queue: int = 16, **kw) -> Distill:
    torch.manual_seed(0)
    student, dim = build_backbone("small_cnn")
    t, tdim = build_backbone(teacher, 16)
    head = DINOHead(tdim, out_dim=32, hidden_dim=16, bottleneck_dim=8, num_layers=2, batch_norm=True)
    return Distill(student, dim, DistillParams(loss=loss, queue_size=queue, **kw), teacher=t, teacher_dim=tdim,
                   teacher_head=head if loss == "dino" else None)


def _keys(n: int, offset: int = 0) -> SampleKeys:
    return SampleKeys(seed=0, epoch=0, indices=torch.arange(offset, offset + n))


def test_kl_is_lightly_trains_batchmean_kl_divergence():
    s, t = torch.randn(6, 5, 9), torch.randn(6, 5, 9)
    theirs = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s.flatten(0, 1), -1), F.softmax(t.flatten(0, 1), -1))
    torch.testing.assert_close(_kl(s, t), theirs)


@pytest.mark.parametrize("loss", ["kl", "mse", "dino"])
def test_only_the_student_learns_and_the_teacher_stays_frozen_in_eval_mode(loss):
    model = _model(loss).train()
    assert not model.teacher.training and all(not p.requires_grad for p in model.teacher.parameters())
    x = torch.randn(8, 3, 16, 16)
    before = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    model([x], keys=_keys(8)).backward()
    assert all(p.grad is None for p in model.teacher.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert (model.head_global is None) == (loss != "kl") and (model.head_local is None) == (loss == "dino")
    assert (model.teacher.head is not None) == (loss == "dino")   # frozen, in eval mode, in the teacher's state
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


def test_dino_loss_is_the_cross_entropy_to_the_centred_teacher_head():
    """loss=dino by hand: H(softmax((h_T(f_T(x)) - c) / 0.07), softmax(h_S(f_S(x)) / 0.1)), the centre moving to
    0.9 c + 0.1 mean(h_T(f_T(x))) after each step; the student's head copies the teacher head's shape."""
    model = _model("dino", mixup=False).train()
    assert model.head.spec == model.teacher.head.spec and model.params.out_dim == 32
    xs = [torch.randn(6, 3, 16, 16) for _ in range(2)]
    center = torch.zeros(1, 32)
    for x in xs:
        with torch.no_grad():
            t = model.teacher.head(dense_features(model.teacher.backbone, x, model.teacher_dim)[0])   # = f_T(x)
            s = model.head(dense_features(model.backbone, x, model.feature_dim)[0])
        want = -(F.softmax((t - center) / 0.07, -1) * F.log_softmax(s / 0.1, -1)).sum(-1).mean()
        torch.testing.assert_close(model([x]), want)
        center = 0.9 * center + 0.1 * t.mean(0, keepdim=True)
        torch.testing.assert_close(model.loss_fn.center, center)


@pytest.mark.parametrize("teacher, fragment", [(None, "is a weights file without one"),
                                               ("moco", "is a moco run without one"),
                                               ("distill", "is a distill run without one")])
def test_a_teacher_without_a_dino_head_is_refused_for_loss_dino(teacher, fragment):
    from unison.config import TrainConfig
    from unison.errors import ConfigError
    from unison.training.teacher import teacher_head_spec

    cfg = TrainConfig(method="distill", teacher="t.pth", teacher_backbone="small_cnn", method_params={"loss": "dino"})
    ckpt = None if teacher is None else {"method": teacher, "config": {"method_params": {}}}
    with pytest.raises(ConfigError, match=f"{fragment}; give a unison run of --method dino or ibot"):
        teacher_head_spec(cfg, ckpt)
    spec = teacher_head_spec(cfg, {"method": "ibot", "config": {"method_params": {"out_dim": 64}}})
    assert spec is not None and spec["out_dim"] == 64 and spec["batch_norm"] is False   # iBOT's head
