"""`unison export` (backbone state dict loadable into torchvision), `unison eval` (kNN + linear probe), errors."""

import json

from unison.cli import main


def test_eval_on_a_trained_run_prints_knn_and_linear_and_writes_json(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-steps", "3", "--batch-size", "64", "--no-progress",
                 "--world-size", "1", "--threads", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run), "--linear-epochs", "30", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "kNN top-1" in out and "linear top-1" in out
    result = json.loads(report.read_text())
    assert 0.0 <= result["knn_top1"] <= 1.0 and 0.0 <= result["linear_top1"] <= 1.0
    assert result["step"] == 3 and result["method"] == "simclr"
    # Same checkpoint, data and k/t as the loop's final kNN: the same number.
    summary = json.loads((run / "summary.json").read_text())
    assert abs(result["knn_top1"] - summary["knn_top1"]) < 1e-9
    assert f"{result['knn_top1']:.4f}" in out and f"{result['linear_top1']:.4f}" in out


def test_eval_never_scores_a_folder_against_itself(tmp_path, capfd):
    """A run on a folder without --val has no held-out data: `unison eval` used to score the kNN and the linear
    probe on the very images they fit (the folder twice: about 100 %); now it asks for --val, and refuses a --val
    that overlaps --data."""
    from unison.data.generated import write_image_folder

    write_image_folder(tmp_path / "train", 32, classes=2, sizes=(16, 16), seed=0)
    write_image_folder(tmp_path / "held", 16, classes=2, sizes=(16, 16), seed=1)
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train"), "--max-steps", "1", "--batch-size", "16",
                 "--no-progress", "--world-size", "1", "--out", str(run)]) == 0
    capfd.readouterr()
    fast = ["--linear-epochs", "2", "--knn-k", "5"]
    for extra, fragment in (([], "no held-out data: --data"), (["--val", str(tmp_path / "train" / "class_0")],
                                                                 "overlaps the training data")):
        assert main(["eval", "--checkpoint", str(run), *fast, *extra]) != 0
        err = capfd.readouterr().err
        assert err.count("unison: error:") == 1 and fragment in err and "Traceback" not in err, err
    assert main(["eval", "--checkpoint", str(run), *fast, "--val", str(tmp_path / "held")]) == 0
    from PIL import Image

    for c in ("class_0", "class_1"):   # 4000 x 1 strips: eval embeds at the run's image size (it took the width: 32 GB)
        (tmp_path / "strips" / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (4000, 1), (60 * i, 0, 0)).save(tmp_path / "strips" / c / f"{i}.png")
    assert main(["eval", "--checkpoint", str(run), *fast, "--val", str(tmp_path / "strips")]) == 0
