"""World-size invariance of whole `unison train` runs: W=1 and W=2 loss curves agree step by step."""

import pytest
from helpers.curves import _report

import unison.equivalence
from unison.cli import main
from unison.equivalence import run_curves


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
