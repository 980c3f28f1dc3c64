"""A run given relative ``--data``/``--val`` records their absolute form beside them (config.json and the
checkpoints), so ``unison eval`` and ``unison embed`` of the run from another folder need no ``--data``/``--val``
again."""

from __future__ import annotations

import json

from unison.cli import main
from unison.data.generated import write_image_folder


def test_eval_from_another_folder_finds_the_runs_relative_data(tmp_path, monkeypatch, capsys, one_torch_thread):
    work = tmp_path / "project"
    write_image_folder(work / "photos", 32, classes=2, sizes=(16, 16), seed=1)
    write_image_folder(work / "held_out", 8, classes=2, sizes=(16, 16), seed=2)
    monkeypatch.chdir(work)
    train = ["train", "--data", "photos", "--val", "held_out", "--batch-size", "16", "--max-steps", "2", "--knn-k",
             "5", "--no-progress", "--no-random-init-knn", "--signal-images", "0", "--out", "runs/r"]
    assert main(train) == 0

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(work / "runs" / "r"), "--linear-epochs", "2", "--knn-k", "5"]) == 0
    out = capsys.readouterr().out
    assert "kNN top-1" in out and "linear top-1" in out
    assert main(["embed", "--checkpoint", str(work / "runs" / "r"), "--out", "f.npy"]) == 0   # the run's data
    assert "32 images" in capsys.readouterr().out
    config = json.loads((work / "runs" / "r" / "config.json").read_text())
    assert config["data"] == "photos" and config["resolved"]["data_path"] == str(work / "photos")
    assert config["val"] == "held_out" and config["resolved"]["val_path"] == str(work / "held_out")
