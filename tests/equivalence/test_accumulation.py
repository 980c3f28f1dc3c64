"""`unison check --grad-sync-every 2`: exact accumulation at W=2 x K=2 for every method, in ONE launch of 2 workers.

Each method is compared with one process on the same global batch: in ONE step where the backbone has no batch
norm (the ViT methods), in the same 2 micro-batches where it has (world-size invariance), float64, 1e-6. The ViT
methods run on a smaller ViT than their recipe's (tests/helpers/every_method.py)."""

import pytest
from helpers.every_method import VIT_METHODS, check_every_method

from unison.methods import METHODS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def accumulated_reports():
    """Every method's check (the ViT methods on a smaller ViT: tests/helpers/every_method.py)."""
    return check_every_method(2, steps=1, local_batch=4, grad_sync_every=2)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_check_passes_with_exact_accumulation(method, accumulated_reports):
    report = accumulated_reports[method]
    assert report.spec.method == method and report.passed, report.summary()
    summary = report.summary()
    assert "grad_sync_every=2 accumulation=exact" in summary
    batch_norm_backbone = method not in VIT_METHODS   # the recipes' ViT methods
    assert ("same 2 micro-batches" if batch_norm_backbone else "ONE step on the whole batch of 16") in summary
