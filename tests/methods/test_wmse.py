"""W-MSE as a method: its sub-batches are a function of (seed, epoch, sample index) over the global batch, of
w_size images each (N / G +- 1 where N is no multiple of it), and a batch or w_size too small to whiten its
embedding is one line before any worker starts."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.methods import WMSE, SampleKeys, WMSEParams
from unison.training.resolve import validate_run


def _model(**params) -> WMSE:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return WMSE(backbone, 4, WMSEParams(**{"proj_hidden_dim": 8, "proj_dim": 2, "w_size": 4, **params}))


@pytest.mark.parametrize("n, w_size, sizes", [(256, 128, [128, 128]), (300, 128, [150, 150]), (100, 128, [100]),
                                              (10, 4, [5, 5])])
def test_sub_batches_split_the_batch_evenly(n, w_size, sizes):
    groups, g = _model(w_size=w_size).groups(SampleKeys(0, 0, torch.arange(n) * 7), torch.device("cpu"))
    assert g == len(sizes) and torch.bincount(groups[0], minlength=g).tolist() == sizes


def test_an_images_sub_batch_depends_on_its_index_not_on_the_batch_order():
    model = _model(w_size=8, w_iter=2)
    indices = torch.arange(100, 132)
    groups = model.groups(SampleKeys(3, 1, indices), torch.device("cpu"))[0]
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    shuffled = model.groups(SampleKeys(3, 1, indices[order]), torch.device("cpu"))[0]
    assert torch.equal(shuffled, groups[:, order])
    assert not torch.equal(groups[0], groups[1])                       # w_iter splits differ
    assert not torch.equal(model.groups(SampleKeys(3, 2, indices), torch.device("cpu"))[0], groups)   # and epochs


def test_a_forward_trains_and_needs_its_keys():
    model = _model()
    views = [torch.randn(12, 3, 8, 8) for _ in range(2)]
    loss = model(views, keys=SampleKeys(0, 0, torch.arange(12)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="keys=SampleKeys"):
        model(views)


def test_a_batch_or_w_size_that_cannot_whiten_the_embedding_is_one_line():
    with pytest.raises(ConfigError, match=r"batch_size=16: W-MSE whitens .* needs more than 64 images"):
        validate_run(TrainConfig(method="wmse", batch_size=16))
    validate_run(TrainConfig(method="wmse", batch_size=66))
    validate_run(TrainConfig(method="wmse", batch_size=16, method_params={"w_eps": 0.1}))   # shrinkage: any batch
    with pytest.raises(ConfigError, match="w_size=64 must exceed proj_dim=64"):
        validate_run(TrainConfig(method="wmse", method_params={"w_size": 64}))
    assert WMSE.smallest_batch(WMSEParams()) == 65
