"""Issue 24: the label-free signals and the online probe are the same at world size 1 and 2 (real worker processes)."""

from __future__ import annotations

import csv

import pytest

from unison.cli import main

RUN = ["train", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
       "--no-random-init-knn", "--signal-images", "100", "--signals-every", "1", "--max-steps", "2", "--log-every", "1",
       "--precision", "float64", "--warmup-epochs", "0"]
SIGNALS = ("rankme", "emb_std", "align", "uniform")


def _rows(run) -> list[dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_signals_and_probe_are_the_same_at_world_size_1_and_2(tmp_path):
    runs = {}
    for w in (1, 2):
        runs[w] = tmp_path / f"w{w}"
        assert main([*RUN, "--world-size", str(w), "--out", str(runs[w])]) == 0
    signals = {w: [r for r in _rows(runs[w]) if r["rankme"]] for w in runs}
    assert [int(r["step"]) for r in signals[1]] == [int(r["step"]) for r in signals[2]] == [0, 1, 2]
    # 100 images: two chunks, embedded by one rank at W=1 and one each at W=2, gathered in the same order
    for k in SIGNALS:   # the same weights at step 0: the same numbers, bit for bit
        assert signals[1][0][k] == signals[2][0][k], k
    for r1, r2 in zip(signals[1][1:], signals[2][1:]):   # after steps: W=2 differs from W=1 by summation order only
        for k in SIGNALS:
            assert float(r1[k]) == pytest.approx(float(r2[k]), rel=1e-9), k
    probe = {w: [float(r["probe_top1"]) for r in _rows(runs[w]) if r["probe_top1"]] for w in runs}
    assert len(probe[1]) == 2 and probe[1] == pytest.approx(probe[2], abs=1e-12)
