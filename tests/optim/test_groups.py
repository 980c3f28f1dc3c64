"""`unison.optim.groups`: block ids, per-block learning-rate factors and --freeze names, on plain names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.optim.groups import frozen_names, layer_scales, param_groups

RESNET = ["conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer2.0.conv1.weight", "layer4.1.bn2.bias"]
VIT = ["cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.bias",
       "norm.weight"]


def test_resnet_and_vit_factors():
    d = 0.5
    assert layer_scales(RESNET, d) == {"conv1.weight": d**5, "bn1.weight": d**5, "layer1.0.conv1.weight": d**4,
                                       "layer2.0.conv1.weight": d**3, "layer4.1.bn2.bias": d}
    vit = layer_scales(VIT, d)   # 2 blocks: embeddings d**3, blocks.0 d**2, blocks.1 d, norm 1
    assert [vit[n] for n in VIT] == [d**3, d**3, d**3, d**2, d, 1.0]


def test_param_groups_give_heads_the_full_rate():
    """Backbone parameters by factor, the projector at 1, frozen ones left out; groups by decreasing factor."""
    named = [(f"backbone.{n}", nn.Parameter(torch.zeros(1))) for n in VIT]
    named += [("projector.0.weight", nn.Parameter(torch.zeros(1)))]
    named[0][1].requires_grad_(False)   # cls_token frozen
    groups = param_groups(named, layer_scales(VIT, 0.5))
    assert [g["lr_scale"] for g in groups] == [1.0, 0.5, 0.25, 0.125]
    assert [len(g["params"]) for g in groups] == [2, 1, 1, 2]


@pytest.mark.parametrize("spec, expected", [
    ("0", {"cls_token", "pos_embed", "patch_embed.proj.weight"}),
    ("1", {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"}),
    ("patch_embed, norm", {"patch_embed.proj.weight", "norm.weight"}),
    ("all", set(VIT)),
])
def test_freeze_specs(spec, expected):
    assert frozen_names(VIT, spec) == expected


@pytest.mark.parametrize("spec, fragment", [
    ("3", "the backbone has 2 blocks"), ("block", "did you mean 'blocks'?"), ("", "is not a list"),
    ("1,,2", "is not a list"),
])
def test_bad_freeze_specs(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        frozen_names(VIT, spec)


def test_layer_decay_needs_numbered_blocks():
    with pytest.raises(ConfigError, match="needs a backbone with numbered blocks"):
        layer_scales(["fc.weight", "fc.bias"], 0.7)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_frozen_batch_norm_keeps_its_running_statistics_through_train_mode_and_syncbn(device):
    """--freeze 1 on the small CNN: the batch norms of conv-BN blocks 0 and 1 stay in eval mode after
    ``train()``, keep their running statistics over a training-mode forward and are not converted to a synchronised
    batch norm (``device``: the GPU's converter's choice, torch.nn.SyncBatchNorm, built on the CPU); block 2's
    batch norm trains and is converted."""
    from unison.distributed.sync_batchnorm import GlobalBatchNorm, RunningStatistics, convert_sync_batchnorm
    from unison.models import build_backbone
    from unison.optim.groups import freeze

    torch.manual_seed(0)
    net, _ = build_backbone("small_cnn", 16)
    freeze(net, "1")
    held, trained = net.features[4], net.features[7]
    assert isinstance(net.features[1], RunningStatistics) and isinstance(held, RunningStatistics)
    assert isinstance(held, nn.BatchNorm2d) and not isinstance(trained, RunningStatistics)
    converted = convert_sync_batchnorm(net, torch.device(device))   # the CPU module: only the factory's class differs
    assert converted.features[4] is held
    assert isinstance(converted.features[7], nn.SyncBatchNorm if device == "cuda" else GlobalBatchNorm)
    if device == "cuda":
        return
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    converted.train()
    assert not held.training and converted.features[7].training
    converted(torch.randn(8, 3, 16, 16) * 3 + 1)
    for k in ("features.1.running_mean", "features.4.running_var", "features.4.num_batches_tracked"):
        assert torch.equal(converted.state_dict()[k], before[k]), k
    assert not torch.equal(converted.state_dict()["features.7.running_mean"], before["features.7.running_mean"])
    assert set(converted.state_dict()) == set(before) and trained is not converted.features[7]
