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
