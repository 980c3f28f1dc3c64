"""`unison.models.vit`: the patch grid a ViT sees at an image size, and the names that pick the patch size."""

from __future__ import annotations

import pytest

from unison.models.vit import AUTO_MIN_GRID, coarse_grid, pin_vit, vit_patch_size


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
