"""Mixup and CutMix in pairs of neighbours (`unison.eval.mix`): a rank's share of the batch mixes as in the whole."""

import pytest
import torch

from unison.errors import ConfigError
from unison.eval.mix import PairMixer, check_pairs


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_the_second_half_of_a_batch_mixes_as_in_the_whole_batch(mixup, cutmix):
    mixer = PairMixer(mixup, cutmix, label_smoothing=0.1, num_classes=5, seed=0)
    x = torch.rand(8, 3, 16, 16, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    idx = torch.tensor([11, 3, 52, 8, 0, 17, 4, 9])
    whole, t_whole = mixer(x, y, idx, epoch=2)
    half, t_half = mixer(x[4:], y[4:], idx[4:], epoch=2)
    assert torch.equal(whole[4:], half) and torch.equal(t_whole[4:], t_half)
    torch.testing.assert_close(t_whole.sum(1), torch.ones(8, dtype=torch.float64))
    assert not torch.equal(whole, x)
    lam = t_whole[0, 0] - 0.1 / 5   # sample 0 keeps lam of itself (class 0), gives 1 - lam to class 1
    assert 0 <= float(lam) <= 0.9 + 1e-12


def test_off_is_the_identity_and_odd_shares_are_refused():
    x, y, idx = torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]), torch.arange(4)
    assert PairMixer(0, 0, 0.1, 2, 0)(x, y, idx, 0) == (x, None)
    with pytest.raises(ConfigError, match="multiple of 4"):
        check_pairs(30, 2)
    check_pairs(32, 2)
    with pytest.raises(ConfigError, match="pairs"):
        PairMixer(0.8, 0, 0, 2, 0)(x[:3], y[:3], idx[:3], 0)
