"""`unison bench lightly --method ...` and `unison bench table --methods seed` end to end at tiny settings (the
embedded digits, a few steps): the commands a user runs, their rows and the files they write. The real runs
(CIFAR-10, hundreds of steps) are in docs/benchmarks.md; every method's Lightly side alone is in
tests/bench/test_lightly_sides.py."""

from __future__ import annotations

import csv
import re

import pytest

from unison.bench.config import SEED_METHODS
from unison.cli import main

TINY = ["--data", "digits", "--val", "digits", "--subset", "64", "--val-subset", "32", "--batch-size", "16",
        "--knn-k", "5"]


def test_bench_lightly_runs_both_sides_of_a_method(tmp_path, capsys):
    pytest.importorskip("lightly")
    out = tmp_path / "bench"
    assert main(["bench", "lightly", "--method", "swav", *TINY, "--lightly-steps", "2",
                 "--lightly-loader-workers", "0", "--lightly-threads", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "lightly.csv")))
    assert [(r["method"], r["side"]) for r in rows] == [("swav", "unison"), ("swav", "lightly")]
    assert all(0 <= float(r["knn_top1"]) <= 1 and float(r["peak_memory_mib"]) > 0 for r in rows)
    md = (out / "lightly.md").read_text()
    assert "**swav: kNN unison - Lightly" in md and "throughput unison / Lightly" in md
    assert "Lightly's swav transform" in md and "adam peak lr" in md   # Lightly's own recipe, named


def test_bench_lightly_by_epochs_scores_both_sides_at_the_same_epochs(tmp_path, capsys):
    pytest.importorskip("lightly")
    out = tmp_path / "bench"
    assert main(["bench", "lightly", "--method", "simclr", *TINY, "--lightly-epochs", "2", "--lightly-eval-every",
                 "1", "--lightly-loader-workers", "0", "--lightly-threads", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "lightly.csv")))
    assert [(r["side"], r["steps"]) for r in rows] == [("unison", "8"), ("lightly", "8")]   # 2 x 64 // 16
    for r in rows:   # "[epoch, kNN] ..." as the CSV writes a list
        epochs = [float(e) for e in re.findall(r"\[([0-9.]+),", r["knn_by_epoch"])]
        assert epochs == [1.0, 2.0], r["knn_by_epoch"]
    md = (out / "lightly.md").read_text()
    assert "### kNN by epoch" in md and "| simclr | 16 | 1 | " in md and "| simclr | 16 | 2 | " in md
    assert "--epochs 2" in rows[0]["command"] and "--eval-every 1" in rows[0]["command"]
    assert "--max-steps" not in rows[0]["command"]


def test_bench_table_for_the_seed_and_its_budget(tmp_path, capsys):
    assert main(["bench", "table", "--methods", "seed", "--dry-run", *TINY]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("unison train")]
    assert len(lines) == 3 * len(SEED_METHODS)
    assert [ln.split("--method ")[1].split()[0] for ln in lines[::3]] == list(SEED_METHODS)
    assert sum("--sync-batchnorm --gather" in ln for ln in lines) == sum("--no-sync-batchnorm --gather" in ln
                                                                          for ln in lines) == len(SEED_METHODS)
    out = tmp_path / "table"
    assert main(["bench", "table", "--methods", "simsiam", *TINY, "--epochs", "1", "--out", str(out)]) == 0
    md = (out / "table.md").read_text()
    assert "**Budget:** 3 runs (1 method x 3 configurations), each 4 steps of 16 images (1 epoch)" in md
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [(r["workers"], r["sync_batchnorm"], r["gather"]) for r in rows] == [
        ("1", "", ""), ("2", "True", "True"), ("2", "False", "True")]
    assert float(rows[0]["speedup"]) == 1.0 and all(float(r["peak_memory_mib"]) > 0 for r in rows)
