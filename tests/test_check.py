"""`unison check`: W=2 real processes vs 1 process on the global batch, and it can fail."""

from unison.check import run_equivalence
from unison.cli import main


def test_simclr_exact_with_syncbn_and_gather():
    report = run_equivalence("simclr", world_size=2, steps=3)
    assert report.passed, report.summary()
    assert max(report.max_rel_loss, report.max_rel_grad, report.max_rel_state) < 1e-10
    assert report.ranks_identical


def test_check_fails_without_syncbn_or_gather(capsys):
    assert main(["check", "--method", "simclr", "--steps", "2", "--no-sync-batchnorm"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "sync_batchnorm=False" in out
    report = run_equivalence("simclr", world_size=2, steps=2, gather_distributed=False)
    assert not report.passed and report.max_rel_loss > 1e-3
    assert "gather is off" in report.summary()
