"""The online probe is in every checkpoint: a run interrupted and resumed reports the probe accuracy of the
uninterrupted run (loss and kNN were already exact; the probe started again from zero weights)."""

from __future__ import annotations

import csv
import json

from unison.cli import main
from unison.training.checkpoint import load_checkpoint

TINY = ["train", "--world-size", "1", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5",
        "--no-progress", "--no-random-init-knn", "--signal-images", "0", "--max-steps", "6", "--checkpoint-every",
        "3", "--log-every", "2", "--precision", "float64", "--threads", "1"]


def _probe(run):
    with open(run / "metrics.csv") as f:
        rows = [(int(r["step"]), r["probe_top1"]) for r in csv.DictReader(f) if r["probe_top1"]]
    return rows, json.loads((run / "summary.json").read_text())["probe_top1"]


def test_a_resumed_run_reports_the_uninterrupted_probe_accuracy(tmp_path, one_torch_thread):
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    assert main([*TINY, "--out", str(ref)]) == 0
    middle = ref / "checkpoints" / "step_00000003.pt"   # between two logged accuracies: the counts travel too
    assert main([*TINY, "--resume", str(middle), "--out", str(resumed)]) == 0
    (ref_rows, ref_final), (rows, final) = _probe(ref), _probe(resumed)
    assert ref_final is not None and final == ref_final
    assert [r for r in ref_rows if r[0] > 3] == rows   # every accuracy logged after the resume
    assert load_checkpoint(middle)["extra"]["online_probe"]["state"]["weight"] is not None


def test_a_damaged_probe_state_is_one_line(tmp_path, capsys, one_torch_thread):
    import torch

    from unison.training.checkpoint import save_checkpoint

    run = tmp_path / "run"
    assert main([*TINY, "--max-steps", "3", "--out", str(run)]) == 0
    ckpt = load_checkpoint(run)
    probe = ckpt["extra"]["online_probe"]["state"]
    probe["optimizer"]["state"][0]["exp_avg"] = torch.zeros(1)   # not the weight's shape
    save_checkpoint(tmp_path / "damaged", ckpt, step=3)
    capsys.readouterr()
    assert main([*TINY, "--resume", str(tmp_path / "damaged"), "--out", str(tmp_path / "b")]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert "online probe" in err[-1] and "does not fit" in err[-1], err
