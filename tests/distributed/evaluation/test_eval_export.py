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
