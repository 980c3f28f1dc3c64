"""`unison.training.describe`: the lines rank 0 prints as a run starts (the run's own values, no process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unison.config import TrainConfig
from unison.training.describe import describe_backbone


@pytest.mark.parametrize("given, pinned, size, warned", [
    ("vit_tiny", "vit_tiny", 32, True), (None, "vit_tiny_p4", 32, False), ("vit_tiny_auto", "vit_tiny_p4", 32, False),
    ("vit_nano_p4", "vit_nano_p4", 16, True), ("small_cnn", "small_cnn", 16, False),
    (None, "vit_nano_p4", 16, False),   # the digits recipe's own choice: not the user's to fix
])
def test_a_vit_with_too_coarse_a_grid_is_warned_of_as_the_run_starts(capsys, given, pinned, size, warned):
    """The backbone the run resolved at its image size, named as the user gave it (a recipe's choice never is)."""
    run = SimpleNamespace(cfg=TrainConfig(backbone=given), resolved={"backbone": pinned}, image_size=size)
    describe_backbone(run)
    err = capsys.readouterr().err
    assert (f"unison: warning: --backbone {given} at {size} px: its" in err) is warned, err
    assert err.count("\n") == int(warned)
