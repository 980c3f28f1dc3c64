"""`unison.models.vit`: the patch grid a ViT sees at an image size, the names that pick the patch size, and the
attention mask (AIM's prefix-causal attention): given to every block, it restricts what each token sees; no mask, or
one allowing everything, computes what the ViT computed before."""

from __future__ import annotations

import pytest
import torch

from unison.models.vit import AUTO_MIN_GRID, ViT, coarse_grid, pin_vit, vit_patch_size


@pytest.mark.parametrize("backbone, pinned, size, fix", [
    ("vit_tiny", "vit_tiny", 32, "give --backbone vit_tiny_auto (vit_tiny_p4 at 32 px: 8 x 8) or a larger --image-size"),
    ("vit_small", "vit_small", 16, "give --backbone vit_small_auto (vit_small_p2 at 16 px: 8 x 8) or a larger"),
    ("vit_nano_p4", "vit_nano_p4", 16, "give --backbone vit_nano_auto (vit_nano_p2 at 16 px: 8 x 8)"),
    ("vit_base_p8", "vit_base_p8", 32, "give --backbone vit_base_auto (vit_base_p4 at 32 px: 8 x 8)"),
    ("vit_tiny_auto", "vit_tiny_p2", 12, "give a larger --image-size"),   # no patch leaves 8 x 8 at 12 px
])
def test_a_grid_below_the_recipes_is_named_with_the_name_that_gives_one(backbone, pinned, size, fix):
    """`--backbone vit_tiny` at 32 px trained on 4 tokens without a word (16 px patches)."""
    assert pin_vit(backbone, size) == pinned
    note = coarse_grid(backbone, vit_patch_size(pinned), size)
    grid = size // vit_patch_size(pinned)
    tokens = "1 token" if grid == 1 else f"{grid * grid} tokens"
    assert note is not None and note.startswith(f"--backbone {backbone} at {size} px: its {vit_patch_size(pinned)} px "
                                                f"patches make a {grid} x {grid} grid ({tokens}), below "
                                                f"the {AUTO_MIN_GRID} x {AUTO_MIN_GRID}"), note
    assert fix in note, note


@pytest.mark.parametrize("backbone, size", [("vit_tiny", 224), ("vit_tiny_p4", 32), ("vit_tiny_p8", 64),
                                            ("vit_tiny_auto", 32), ("vit_tiny_auto", 16), ("vit_tiny_auto", 224)])
def test_the_recipes_grids_are_not_warned_of(backbone, size):
    assert coarse_grid(backbone, vit_patch_size(pin_vit(backbone, size)), size) is None


def test_a_timm_vit_is_told_the_patch_size_that_gives_the_grid():
    note = coarse_grid("timm:vit_tiny_patch16_224", 16, 32)
    assert note is not None and "give --backbone-arg patch_size=4 (8 x 8) or a larger --image-size" in note
    assert coarse_grid("small_cnn", None, 16) is None   # not patch-based


def _vit() -> ViT:
    torch.manual_seed(0)
    return ViT(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2).double().eval()


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_a_mask_allowing_everything_is_no_mask():
    vit, x = _vit(), _images()
    everything = torch.ones(2, 1, 17, 17, dtype=torch.bool)
    torch.testing.assert_close(vit.forward_tokens(x, attn_mask=everything), vit.forward_tokens(x), rtol=1e-12,
                               atol=1e-12)


def test_a_causal_mask_hides_the_later_tokens():
    vit, x = _vit(), _images()
    causal = torch.ones(17, 17, dtype=torch.bool).tril().expand(2, 1, 17, 17)
    before = vit.forward_tokens(x, attn_mask=causal)
    changed = x.clone()
    changed[:, :, 2:4, 4:6] += 5.0                       # patch 6 (row 1, column 2): token 7
    after = vit.forward_tokens(changed, attn_mask=causal)
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=1e-12, atol=1e-12)   # tokens before it: unchanged
    assert (after[:, 7:] - before[:, 7:]).abs().amax(dim=-1).min() > 1e-6              # it and later ones: changed
    unmasked = vit.forward_tokens(changed)
    assert (unmasked[:, :7] - vit.forward_tokens(x)[:, :7]).abs().max() > 1e-6         # without the mask: seen


def test_a_mask_of_the_wrong_shape_or_dtype_is_refused():
    vit, x = _vit(), _images()
    with pytest.raises(ValueError, match="attn_mask must be boolean"):
        vit.forward_tokens(x, attn_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be boolean"):
        vit.forward_tokens(x, attn_mask=torch.ones(2, 1, 17, 17))
