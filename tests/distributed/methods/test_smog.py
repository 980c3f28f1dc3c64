"""SMoG's resets at W=2 (real gloo processes, different data on each rank) equal one process on the global batch:
the shared bank, rank 0's k-means broadcast and the momentum network copied from the online one leave every
rank's state identical and equal to the single process's (float64, 1e-6)."""

from __future__ import annotations

import pytest

from unison.equivalence import run_equivalence

pytestmark = pytest.mark.distributed


def test_resets_of_the_groups_are_exact_at_two_workers():
    params = {"reset_every": 2, "n_groups": 4, "bank_size": 24, "proj_hidden_dim": 16, "pred_hidden_dim": 16}
    report = run_equivalence("smog", world_size=2, steps=4, method_params=params)   # resets after steps 2 and 4
    assert report.passed and report.ranks_identical, report.summary()
