"""AIM in one process: prefix lengths from the sample keys, prefix-causal attention (a prediction never sees the
patch it predicts nor a later one), the fixed sin-cos positions, the bidirectional embedding, and the one-line
refusals. Its W=2 exactness is `unison check` (tests/helpers/every_method.py)."""

from __future__ import annotations

import pytest
import torch

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.methods import METHODS, SampleKeys
from unison.methods.aim import AIM, AIMParams, prefix_causal_mask
from unison.methods.mae import sincos_positions
from unison.models.vit import ViT
from unison.training.resolve import resolve_recipe

KEYS = SampleKeys(seed=0, epoch=0, indices=torch.arange(40))


def _build(**params) -> AIM:
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2)
    p = AIMParams(**{"head_dim": 16, "head_blocks": 1, **params})
    AIM.init_backbone(vit, p)            # what the training layer does for the backbone it builds
    return AIM(vit, 16, p).double()


def _images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_registered_with_its_recipe():
    assert METHODS["aim"] is AIM
    recipe = resolve_recipe(TrainConfig(method="aim", data="/data/images"), 224)
    assert (recipe.augmentation, recipe.optimizer, recipe.lr, recipe.weight_decay) == ("aim", "adamw", 6.25e-5, 0.05)


def test_prefix_lengths_come_from_the_keys_and_cover_1_to_n_minus_1():
    model = _build()
    prefix = model.prefix_lengths(KEYS, 0, 16, torch.device("cpu"))
    assert prefix.dtype == torch.long and int(prefix.min()) >= 1 and int(prefix.max()) <= 15
    assert len(set(prefix.tolist())) > 8
    halves = [model.prefix_lengths(SampleKeys(0, 0, part), 0, 16, torch.device("cpu")) for part in KEYS.indices.split(20)]
    assert torch.equal(torch.cat(halves), prefix)          # independent of the batch (and the rank)
    assert not torch.equal(model.prefix_lengths(SampleKeys(0, 1, KEYS.indices), 0, 16, torch.device("cpu")), prefix)


def test_the_mask_is_prefix_bidirectional_and_causal_after():
    allowed = prefix_causal_mask(torch.tensor([2]), 4)[0, 0]       # tokens: class, patches 0..3
    expected = torch.tensor([[1, 1, 1, 0, 0],                       # the class token and the 2 prefix patches see
                             [1, 1, 1, 0, 0],                       # each other, the later patches what came before
                             [1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0],
                             [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_a_prediction_never_sees_its_patch_or_a_later_one():
    model = _build()
    x = _images()
    vit = model.backbone
    prefix = torch.tensor([3, 3])
    mask = prefix_causal_mask(prefix, 16)
    pred = model.head(vit.forward_tokens(x, attn_mask=mask)[:, :16])
    changed = x.clone()
    changed[:, :, 2:4, 2:4] += 4.0                                   # patch 5 (row 1, column 1)
    other = model.head(vit.forward_tokens(changed, attn_mask=mask)[:, :16])
    torch.testing.assert_close(other[:, :6], pred[:, :6], rtol=1e-12, atol=1e-12)   # predictions of patches 0..5
    assert (other[:, 6:] - pred[:, 6:]).abs().amax(dim=-1).min() > 1e-8           # patch 6 on: they see patch 5


def test_fixed_sincos_positions_and_a_bidirectional_embedding():
    model = _build()
    vit = model.backbone
    assert not vit.pos_embed.requires_grad
    torch.testing.assert_close(vit.pos_embed[0, 1:], sincos_positions(4, 16, vit.pos_embed))
    assert not vit.pos_embed[0, 0].any()
    loss = model([_images()], keys=SampleKeys(0, 0, torch.tensor([1, 2])))
    loss.backward()
    assert vit.pos_embed.grad is None and vit.patch_embed.proj.weight.grad is not None
    torch.testing.assert_close(model.embed(_images()), vit.forward_tokens(_images())[:, 1:].mean(dim=1))
    assert _build(fixed_positions=False).backbone.pos_embed.requires_grad


def test_weights_given_with_init_keep_their_positions(tmp_path):
    """`unison train --method aim --init W`: the position table of W is kept (frozen), not replaced by sin-cos."""
    from unison.models import build_backbone
    from unison.training.init_read import init_weights_of
    from unison.training.model import build_method

    vit, _ = build_backbone("vit_micro_p2")
    torch.nn.init.normal_(vit.pos_embed)
    torch.save(vit.state_dict(), tmp_path / "weights.pt")
    cfg = TrainConfig(method="aim", backbone="vit_micro_p2", init=str(tmp_path / "weights.pt"))
    cpu = torch.device("cpu")
    loaded = build_method(cfg, 1, torch.float32, cpu, 16, setup={}, init=init_weights_of(cfg)).backbone
    assert torch.equal(loaded.pos_embed, vit.pos_embed) and not loaded.pos_embed.requires_grad
    fresh = build_method(TrainConfig(method="aim", backbone="vit_micro_p2"), 1, torch.float32, cpu, 16, setup={})
    torch.testing.assert_close(fresh.backbone.pos_embed[0, 1:], sincos_positions(8, 128, vit.pos_embed))


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="at least 2 patches"):
        _build().prefix_lengths(KEYS, 0, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match="head_dim"):
        AIMParams(head_dim=0)
    with pytest.raises(ValueError, match="keys=SampleKeys"):
        _build()([_images()])
