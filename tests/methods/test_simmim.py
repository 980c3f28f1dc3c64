"""SimMIM in one process: masks of whole mask patches (2 x 2 ViT patches, the paper's count, from the sample keys),
the encoder's mask tokens, the linear head's loss on the masked pixels only, and the one-line refusals. Its W=2
exactness is `unison check` (tests/helpers/every_method.py)."""

from __future__ import annotations

import pytest
import torch

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.methods import METHODS, SampleKeys
from unison.methods.simmim import SimMIM, SimMIMParams, mask_grid
from unison.models.vit import ViT
from unison.training.resolve import resolve_recipe

KEYS = SampleKeys(seed=0, epoch=0, indices=torch.tensor([3, 14, 15, 92]))


def _build(**params) -> SimMIM:
    torch.manual_seed(0)
    vit = ViT(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2)
    return SimMIM(vit, 16, SimMIMParams(**params)).double()


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_registered_with_its_recipe():
    assert METHODS["simmim"] is SimMIM
    recipe = resolve_recipe(TrainConfig(method="simmim", data="/data/images"), 224)
    assert (recipe.augmentation, recipe.optimizer, recipe.lr, recipe.weight_decay) == ("simmim", "adamw", 1e-4, 0.05)


def test_masks_are_whole_mask_patches_drawn_per_sample():
    assert mask_grid(SimMIMParams(), 14) == (7, 30)       # 224 px, 16 px patches: 30 of 49 32-px squares (ceil)
    assert mask_grid(SimMIMParams(), 8) == (4, 10)
    model = _build()
    masked = model.masked_patches(KEYS, 0, 4, torch.device("cpu"))     # a 4 x 4 grid: 2 x 2 mask patches
    assert masked.shape == (4, 3 * 4)                                 # ceil(0.6 * 4) = 3 mask patches of 4 patches
    for row in masked.tolist():
        blocks = {(p // 4 // 2, p % 4 // 2) for p in row}
        assert len(blocks) == 3 and all(sum((p // 4 // 2, p % 4 // 2) == b for p in row) == 4 for b in blocks)
    halves = [model.masked_patches(SampleKeys(0, 0, part), 0, 4, torch.device("cpu")) for part in KEYS.indices.split(2)]
    assert torch.equal(torch.cat(halves), masked)          # independent of the batch (and the rank)


def test_the_loss_reads_only_the_masked_pixels():
    model = _build()
    x = _images()
    loss = model([x], keys=KEYS)
    masked = model.masked_patches(KEYS, 0, 4, torch.device("cpu"))[0].tolist()
    for patch in (masked[0], next(p for p in range(16) if p not in masked)):
        changed = x.clone()
        r, c = divmod(patch, 4)
        changed[0, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2] += 3.0
        other = model([changed], keys=KEYS)
        assert not torch.equal(other, loss), patch   # masked: the target moved; visible: the encoder's input did
    loss.backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0
    assert model.head.weight.grad is not None


def test_mask_tokens_hide_the_masked_pixels_from_the_encoder():
    model = _build()
    x = _images()
    masked = model.masked_patches(KEYS, 0, 4, torch.device("cpu"))
    is_masked = torch.zeros(4, 16, dtype=torch.bool).scatter_(1, masked, True)
    changed = x.clone()
    r, c = divmod(int(masked[0, 0]), 4)
    changed[0, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2] += 3.0
    vit = model.backbone
    torch.testing.assert_close(vit.forward_tokens(changed, mask=is_masked, mask_token=model.mask_token),
                               vit.forward_tokens(x, mask=is_masked, mask_token=model.mask_token))


def test_bad_parameters_are_one_line():
    with pytest.raises(ConfigError, match="mask_ratio=0 masks nothing"):
        SimMIMParams(mask_ratio=0.0)
    with pytest.raises(ConfigError, match="do not tile the 8 x 8 patch grid"):
        SimMIM.check_views(SimMIMParams(mask_unit=3), 2, [16])
    SimMIM.check_views(SimMIMParams(), 16, [224])
    with pytest.raises(ValueError, match="keys=SampleKeys"):
        _build()([_images()])
