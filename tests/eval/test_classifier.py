"""The classifier of fine-tuning and the standard linear protocol (`unison.eval.classifier`): its head, the frozen
backbone, and drop path drawn per sample from (seed, epoch, index)."""

import pytest
import torch

from unison.errors import ConfigError
from unison.eval.classifier import Classifier, KeyedDropPath, install_drop_path
from unison.models import build_backbone


def test_the_head_is_seeded_on_its_own_and_the_global_generator_is_untouched():
    net, dim = build_backbone("small_cnn")
    state = torch.random.get_rng_state()
    a = Classifier(net, dim, 10, head_init_std=0.01, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = Classifier(net, dim, 10, head_init_std=0.01, seed=3)
    c = Classifier(net, dim, 10, head_init_std=0.01, seed=4)
    assert torch.equal(a.head.weight, b.head.weight) and not torch.equal(a.head.weight, c.head.weight)
    assert float(a.head.weight.detach().std()) == pytest.approx(0.01, rel=0.2) and not a.head.bias.any()


def test_a_frozen_backbone_keeps_its_weights_and_statistics_in_training_mode():
    net, dim = build_backbone("small_cnn")
    model = Classifier(net, dim, 4, head_norm=True, frozen=True).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(torch.randn(8, 3, 16, 16)).logsumexp(1).mean()
    loss.backward()
    opt.step()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert not net.training and model.norm.training and [n for n, p in model.named_parameters() if p.requires_grad] == [
        "head.weight", "head.bias"]


def test_drop_path_of_a_sample_does_not_depend_on_its_batch():
    net, _ = build_backbone("vit_micro_p2")
    keys = install_drop_path(net, 0.5)
    rates = [m.rate for m in net.modules() if isinstance(m, KeyedDropPath)]
    assert rates == [0.0, 0.0, 0.5, 0.5]   # linear over the blocks, as timm's drop_path_rate
    net.train()
    x = torch.randn(6, 3, 16, 16)
    idx = torch.tensor([40, 7, 13, 2, 99, 5])
    keys.set(seed=0, epoch=1, indices=idx)
    whole = net(x)
    keys.set(seed=0, epoch=1, indices=idx[3:])
    part = net(x[3:])
    torch.testing.assert_close(whole[3:], part, rtol=1e-5, atol=1e-6)
    keys.set(seed=0, epoch=2, indices=idx)
    assert not torch.allclose(net(x), whole)   # another epoch, other decisions
    keys.clear()
    assert torch.allclose(net.eval()(x), net(x))


def test_drop_path_needs_transformer_blocks():
    net, _ = build_backbone("small_cnn")
    assert install_drop_path(net, 0.0) is None
    with pytest.raises(ConfigError, match="--drop-path 0.1 needs a transformer backbone"):
        install_drop_path(net, 0.1)
