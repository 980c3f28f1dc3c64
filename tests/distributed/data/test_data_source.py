"""Choosing the data path (memory / stream), the kNN sets beside it, and a training run on streamed data."""

from __future__ import annotations

import csv
import json

import pytest

from unison.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--world-size", "1", "--batch-size", "16", "--epochs", "1", "--no-progress", "--knn-k", "5",
        "--image-size", "16", "--threads", "1"]


def test_streamed_training_run_with_knn_on_held_out_data(folders, tmp_path, capfd):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", folders["train"], "--val", folders["val"], "--data-mode", "stream",
            "--loader-workers", "1", "--out", str(out)]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "streaming 48 images" in err and "1 loader process(es)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_images"] == 48 and summary["val_images"] == 12 and summary["steps"] == 3
    assert 0 <= summary["knn_top1"] <= 1 and 0 <= summary["data_wait_fraction"] <= 1
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["data_mode"] == "stream" and resolved["image_size"] == 16
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert all(0 <= float(r["data_wait"]) <= 1 for r in rows if r["loss"])


@pytest.mark.parametrize("layout, given, why", [
    ("flat", [], "has no labels"), ("train", [], "no --val held-out data"),
    ("train", ["--no-knn"], "skipped: --no-knn"),   # the reason is the flag, not a --val to give
], ids=["flat", "no-val", "no-knn"])
def test_knn_is_skipped_with_one_line_without_labelled_held_out_data(folders, tmp_path, capfd, layout, given, why):
    out = tmp_path / "run"
    assert main(["train", *TINY, *given, "--data", folders[layout], "--max-steps", "1", "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert sum("kNN evaluation skipped" in line for line in captured.err.splitlines()) == 1
    assert why in captured.err and "kNN not measured" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["knn_top1"] is None and summary["val_images"] == 0
