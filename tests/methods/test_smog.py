"""SMoG as a method: the groups move synchronously and are stored after the forward, the views swap roles every
other step, the bank keeps the last projections in order, a reset replaces the groups by the bank's k-means centres
and the momentum network by the online one, and all of it is checkpointed rank-local state.

SMoG's resets at W=2 (real gloo processes, different data on each rank) equal one process on the global batch:
the shared bank, rank 0's k-means broadcast and the momentum network copied from the online one leave every
rank's state identical and equal to the single process's (float64, 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.config import TrainConfig
from unison.distributed.tagging import rank_local_state_names
from unison.equivalence import run_equivalence
from unison.errors import ConfigError
from unison.methods import SMoG, SMoGParams
from unison.training.resolve import validate_run


def _model(**params) -> SMoG:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SMoG(backbone, 4, SMoGParams(**{"proj_hidden_dim": 8, "proj_dim": 4, "pred_hidden_dim": 8, "n_groups": 3,
                                           "bank_size": 8, "reset_every": 2, **params}))


def _views(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]


def test_groups_are_stored_and_the_bank_fills_in_order():
    model = _model()
    before = model.groups.clone()
    model(_views(0))
    assert not torch.equal(model.groups, before) and int(model.bank_ptr) == 4
    model.eval()
    frozen = model.groups.clone()
    model(_views(1))
    assert torch.equal(model.groups, frozen) and int(model.bank_ptr) == 4   # evaluation moves nothing


def test_the_views_swap_roles_every_other_step():
    a, b = _views(2)
    odd = _model()
    odd.step_count.fill_(1)
    even = copy.deepcopy(odd)
    even.step_count.fill_(0)
    assert odd([a, b]).item() == pytest.approx(even([b, a]).item(), rel=1e-12)


def test_a_reset_takes_the_banks_k_means_centres_and_the_online_network():
    from sklearn.cluster import KMeans

    model = _model()
    for step in range(2):
        model(_views(step)).backward()
        model.on_after_step(step)                                     # step 1: (1 + 1) % reset_every == 0
    bank = model.bank.double().numpy()
    centres = F.normalize(torch.from_numpy(KMeans(3, n_init=1, random_state=1).fit(bank).cluster_centers_), dim=1)
    torch.testing.assert_close(model.groups, centres.float())
    for name in ("backbone", "projector"):
        online, target = getattr(model, name).state_dict(), getattr(model.target, name).state_dict()
        assert all(torch.equal(online[k], target[k]) for k in online), name


def test_groups_bank_and_counters_are_checkpointed_rank_local_state():
    model = _model()
    assert {"groups", "bank", "bank_ptr", "step_count"} <= set(model.state_dict())
    assert {"groups", "bank", "bank_ptr", "step_count"} <= set(rank_local_state_names(model))


def test_a_bank_smaller_than_a_step_or_than_the_groups_is_one_line():
    with pytest.raises(ConfigError, match="bank_size=100 is smaller than the global batch 256"):
        validate_run(TrainConfig(method="smog", method_params={"bank_size": 100, "n_groups": 10}))
    with pytest.raises(ConfigError, match="bank_size=100 is smaller than n_groups=300"):
        validate_run(TrainConfig(method="smog", method_params={"bank_size": 100}))


# -- with real processes --



@pytest.mark.distributed
def test_resets_of_the_groups_are_exact_at_two_workers():
    params = {"reset_every": 2, "n_groups": 4, "bank_size": 24, "proj_hidden_dim": 16, "pred_hidden_dim": 16}
    report = run_equivalence("smog", world_size=2, steps=4, method_params=params)   # resets after steps 2 and 4
    assert report.passed and report.ranks_identical, report.summary()
