"""`unison bench race` end to end at a tiny budget: both sides train (unison's through --time-budget, Lightly's
documented pipeline in its own process), every snapshot is scored by the same kNN, and the report, curve and plot
are written. The embedded digits data stand in for CIFAR-10 (the real race: docs/benchmarks.md)."""

import json
import os

import pytest

from unison.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("UNISON_LONG_TESTS"),
                                 reason="set UNISON_LONG_TESTS=1: two 30 s sides and their kNN (1-2 min on 2 cores)")]


def test_race_at_a_tiny_budget(tmp_path):
    pytest.importorskip("lightly", reason="the race's other side is Lightly SSL: pip install 'unison[bench]'")
    out = tmp_path / "race"
    assert main(["bench", "race", "--data", "digits", "--val", "digits", "--race-subset", "512", "--budget", "30s",
                 "--race-points", "2", "--batch-size", "64", "--knn-k", "20", "--out", str(out)]) == 0
    result = json.loads((out / "race.json").read_text())
    for side in result["sides"]:
        assert side["steps"] >= 1 and 0.0 <= side["knn_top1"] <= 1.0, side
        points = [p for p in result["points"] if p["side"] == side["side"]]
        # each side stops near its budget (past it by at most a step, and Lightly's loader start, under load)
        assert points and max(p["time_s"] for p in points) <= 30 * 2, points
    assert result["sides"][0]["used_s"] <= 30 + 10
    md = (out / "race.md").read_text()
    assert "unison passed Lightly's final kNN after" in md and "--time-budget 30s" in md
    assert (out / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
