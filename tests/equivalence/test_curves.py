"""World-size invariance of whole `unison train` runs: W=1 and W=2 loss curves agree step by step."""

import pytest
from helpers.curves import _report

import unison.equivalence
from unison.cli import main
from unison.equivalence import run_curves


def test_float32_verdict_needs_rounding_level_agreement_at_step_1():
    assert _report([1e-7, 1e-3, 2e-2]).passed            # drift later on is float32 rounding, amplified
    assert not _report([4e-3, 4e-3, 4e-3]).passed        # per-rank batch norm shows at step 1
    assert not _report([1e-7, 1e-1]).passed              # beyond the drift bound
    assert not _report([1e-12, 1e-7], "float64").passed  # float64: one tight bound at every step


# -- with real processes --

@pytest.mark.slow
def test_w1_and_w2_training_runs_have_the_same_loss_curve(tmp_path):
    report = run_curves("simclr", steps=20, world_sizes=(1, 2), batch_size=32, out=str(tmp_path))
    assert report.precision == "float64" and report.complete, report.summary()
    assert report.passed and report.max_rel < 1e-10, report.summary()
    w1 = report.curves[1]
    assert max(w1) - min(w1) > 1e-3, "the loss never moved; the comparison would be vacuous"
    assert (tmp_path / "w2" / "metrics.csv").exists() and "PASS" in report.summary()


def test_check_run_flag_routes_to_run_curves(monkeypatch, capsys):
    seen = {}

    def fake(method, check, curve, params):
        seen.update(method=method, check=check, curve=curve)
        return _report([0.0, 0.0], "float64")

    monkeypatch.setattr(unison.equivalence, "run_curves_for_check", fake)
    assert main(["check", "--run", "--run-steps", "7", "--world-size", "4", "--seed", "3"]) == 0
    assert seen["method"] == "simclr" and seen["curve"]["run_steps"] == 7
    assert seen["check"]["world_size"] == 4 and seen["check"]["seed"] == 3
    assert "PASS" in capsys.readouterr().out
