"""Real runs (issue 22): `unison eval` gives the training loop's own kNN number on variable-size images (the run
streamed them), and `unison embed` in 2 processes writes what 1 process writes, byte for byte."""

from __future__ import annotations

import json

from unison.cli import main
from unison.data.generated import write_image_folder

FAST = ["--max-steps", "1", "--batch-size", "16", "--no-progress", "--world-size", "1", "--backbone", "small_cnn",
        "--image-size", "16", "--knn-k", "5", "--no-random-init-knn", "--loader-workers", "0"]


def test_eval_equals_the_training_knn_and_embed_is_world_size_invariant(tmp_path, capfd):
    modes = (("RGB", "JPEG", ".jpg"), ("RGB", "PNG", ".png"))
    write_image_folder(tmp_path / "train", 48, classes=2, sizes=(18, 70), seed=0, modes=modes)
    write_image_folder(tmp_path / "val", 20, classes=2, sizes=(18, 70), seed=1, modes=modes)
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train"), "--val", str(tmp_path / "val"), "--data-mode", "stream",
                 *FAST, "--out", str(run)]) == 0
    capfd.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--no-linear", "--knn-k", "5",
                 "--json", str(tmp_path / "e.json")]) == 0
    assert "resized" not in capfd.readouterr().err
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["knn_top1"] == json.loads((run / "summary.json").read_text())["knn_top1"]

    outs = []
    for world in (1, 2):
        out = tmp_path / f"w{world}.npy"
        assert main(["embed", "--checkpoint", str(run), "--data", str(tmp_path / "val"), "--out", str(out),
                     "--world-size", str(world), "--batch-size", "4", "--threads", "1"]) == 0
        outs.append((out.read_bytes(), (tmp_path / f"w{world}.names.csv").read_text()))
    assert outs[0] == outs[1] and outs[0][1].count("\n") == 21
    assert not [p for p in tmp_path.iterdir() if ".parts-" in p.name or p.name.endswith(".tmp")]
