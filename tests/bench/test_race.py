"""`unison bench race`'s result from its evaluation points: final accuracies, the time unison passes Lightly's final
accuracy, the report and the plot; and the options (budget, points).

`unison bench race` end to end at a tiny budget: both sides train (unison's through --time-budget, Lightly's
documented pipeline in its own process), every snapshot is scored by the same kNN, and the report, curve and plot
are written. The embedded digits data stand in for CIFAR-10 (the real race: docs/benchmarks.md)."""

import json
import os

import pytest

from benchmarks.lab.config import config_from_overrides
from benchmarks.lab.race import held_out_name, summarise, write_race
from unison.cli import main
from unison.errors import ConfigError

SIDES = [{"side": s, "version": "v", "pipeline": "p", "budget_s": 60.0, "used_s": 59.0, "steps": 10,
          "global_batch": 64, "load_1m": 1.0, "load_1m_after": 1.5, "command": "c"} for s in ("unison", "lightly")]


def _points(unison, lightly):
    return ([{"side": "unison", "time_s": t, "step": i, "knn_top1": a} for i, (t, a) in enumerate(unison)]
            + [{"side": "lightly", "time_s": t, "step": i, "knn_top1": a} for i, (t, a) in enumerate(lightly)])


def test_time_to_pass_lightly_is_unisons_first_point_at_or_above_its_final(tmp_path):
    # points out of order on purpose: the curve is sorted by time
    result = summarise([dict(s) for s in SIDES], _points([(30, 0.5), (10, 0.3), (60, 0.6), (20, 0.45)],
                                                         [(20, 0.3), (60, 0.45), (40, 0.4)]), "/data/cifar10/test")
    assert result["unison_passes_lightly_s"] == 20
    assert [s["knn_top1"] for s in result["sides"]] == [0.6, 0.45]
    paths = write_race(result, tmp_path)
    md = paths["md"].read_text()
    assert "passed Lightly's final kNN after 20.0 s (33% of the budget)" in md and "| unison | v | p |" in md
    assert md.startswith("kNN top-1 on /data/cifar10/test.") and "snapshot on /data/cifar10/test," in md  # as given
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(paths["csv"].read_text().splitlines()) == 1 + 7


def test_unison_never_passing_is_said_so(tmp_path):
    result = summarise([dict(s) for s in SIDES], _points([(10, 0.3), (60, 0.4)], [(60, 0.45)]),
                       held_out_name("train", None))
    assert result["unison_passes_lightly_s"] is None
    md = write_race(result, tmp_path)["md"].read_text()
    assert "not within its evaluation points" in md and "kNN top-1 on images held back from train." in md


def test_race_options():
    cfg = config_from_overrides({"budget": "90s", "race_points": 3})
    assert cfg.budget == "90s" and cfg.race_subset is None
    assert config_from_overrides({}).budget == "15m"
    with pytest.raises(ConfigError, match="--budget"):
        config_from_overrides({"budget": "soon"})
    with pytest.raises(ConfigError, match="race_points"):
        config_from_overrides({"race_points": 0})


# -- with real processes --

long_test = pytest.mark.skipif(not os.environ.get("UNISON_LONG_TESTS"),
                               reason="set UNISON_LONG_TESTS=1: two 30 s sides and their kNN (1-2 min on 2 cores)")


@pytest.mark.distributed
@pytest.mark.slow
@long_test
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
