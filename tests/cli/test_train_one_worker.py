"""`unison train` at one worker, in process, on a few steps of the embedded digits: a fresh run into an earlier run's
directory moves that run aside and never mixes the two; one-view methods measure the alignment of two draws of their
augmentation, not of one view with itself."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from unison.cli import main

TINY = ["--no-progress", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5",
        "--world-size", "1", "--no-random-init-knn", "--signal-images", "32"]


def _steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in csv.DictReader((run / "metrics.csv").read_text().splitlines()) if r["loss"]]


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def test_a_fresh_run_into_an_earlier_runs_directory_moves_that_run_aside(tmp_path, capfd):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--max-steps", "2", "--checkpoint-every", "2", "--out", str(run)]) == 0
    first = {name: (run / name).read_bytes() for name in ("config.json", "metrics.csv", "train.log", "summary.json")}
    capfd.readouterr()
    assert main(["train", *TINY, "--max-steps", "1", "--checkpoint-every", "1", "--out", str(run)]) == 0
    err = capfd.readouterr().err
    (moved,) = [line for line in err.splitlines() if "held an earlier run" in line]
    (earlier,) = (run / "earlier-runs").iterdir()
    assert f"moved checkpoints/, config.json, metrics.csv, plot.png, summary.json, train.log to {earlier}" in moved
    # the new run is alone in its directory: its own checkpoints, its own metrics, one line in its plot
    assert _checkpoints(run) == ["step_00000001.pt"]
    assert _steps(run) == [1]
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    log = (run / "train.log").read_text()
    assert "starting: 2 step" not in log and "starting: 1 step " in log and "held an earlier run" in log
    # nothing of the earlier run is lost: every file as it was, a run directory of its own
    assert _checkpoints(earlier) == ["step_00000002.pt"]
    assert {name: (earlier / name).read_bytes() for name in first} == first
    assert (earlier / "plot.png").is_file()
    # --resume auto continues the new run from its step 1, not the earlier one's step 2
    capfd.readouterr()
    assert main(["train", *TINY, "--max-steps", "2", "--resume", "auto", "--out", str(run)]) == 0
    assert "resuming at step 1" in (run / "train.log").read_text() and _steps(run) == [1, 2]
    assert "held an earlier run" not in capfd.readouterr().err and len(list((run / "earlier-runs").iterdir())) == 1


def test_a_one_view_method_measures_the_alignment_of_two_views(tmp_path):
    """mae, ijepa and distill train on one view: the signals compared that view with itself, and the alignment was
    0.000 at every evaluation (train.log, metrics.csv, summary.json, TensorBoard, plot.png). A second draw of the
    method's augmentation gives the two views (distill: a small CNN from a random teacher, the cheapest of the three)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--method", "distill", "--teacher", "random", "--teacher-backbone", "small_cnn",
                 "--backbone", "small_cnn", "--max-steps", "1", "--out", str(run)]) == 0
    logged = [float(m) for m in re.findall(r"alignment ([0-9.]+),", (run / "train.log").read_text())]
    rows = [float(r["align"]) for r in csv.DictReader((run / "metrics.csv").read_text().splitlines()) if r["align"]]
    assert len(logged) == len(rows) == 2 and all(a > 0.001 for a in logged + rows)
    assert json.loads((run / "summary.json").read_text())["signals"]["align"] == rows[-1]
