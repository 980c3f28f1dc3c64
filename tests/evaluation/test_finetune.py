"""``unison eval --fine-tune``, ``--linear-protocol standard``, ``--labels`` and ``--from-scratch`` in one process:
resume after a stop, the labels drawn, the report, the frozen backbone, and the one-line refusals.

``unison eval --fine-tune`` and ``--linear-protocol standard`` on 2 real worker processes (gloo on loopback, each
its own half of every global batch) against one process on the global batch, in float64: the same classifier
after the same steps, within 1e-9 relative (the two ranks' sums add in another order than one process's), and
the same scores. The ViT case runs every recipe part that draws random numbers: drop path, mixup and cutmix; the
streamed case a folder of JPEGs of many sizes, decoded and cropped by loader processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.finetune import classifier_state, digits_checkpoint, max_rel_difference

import unison
from unison.cli import main

# 128 labelled digits in batches of 32: 4 steps an epoch; 64 held-out images
FAST = ["--threads", "1", "--val-subset", "64", "--labels", "128", "--train-batch-size", "32"]
FINE_TUNE = ["--no-knn", "--no-linear", "--fine-tune", "--epochs", "2", "--precision", "float64", *FAST]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("finetune") / "run")


def _eval(run, out, *argv):
    return main(["eval", "--checkpoint", str(run), "--out", str(out), *argv])


def test_an_interrupted_fine_tuning_resumed_equals_an_uninterrupted_one(run, tmp_path, monkeypatch, capsys):
    assert _eval(run, tmp_path / "whole", *FINE_TUNE) == 0
    monkeypatch.setenv("UNISON_EVAL_STOP_AT_STEP", "5")   # SIGTERM to itself before step 5, as a preemption
    assert _eval(run, tmp_path / "parts", *FINE_TUNE) == 75
    assert "continue it with the same command and --resume" in capsys.readouterr().err
    stopped = torch.load(tmp_path / "parts" / "fine-tune" / "checkpoint.pt", weights_only=True)
    assert (stopped["step"], stopped["done"]) == (6, False)   # the step under way when the signal came finished
    monkeypatch.delenv("UNISON_EVAL_STOP_AT_STEP")
    assert _eval(run, tmp_path / "parts", *FINE_TUNE, "--resume") == 0
    whole, parts = (classifier_state(tmp_path / d / "fine-tune") for d in ("whole", "parts"))
    assert all(torch.equal(whole[k], parts[k]) for k in whole)   # bit for bit: the same steps, in one process
    a, b = (json.loads((tmp_path / d / "eval.json").read_text())["full"][0] for d in ("whole", "parts"))
    assert (a["top1"], a["top5"], a["steps"]) == (b["top1"], b["top5"], 8) and b["resumed_from"] == 6
    rows = (tmp_path / "parts" / "fine-tune" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,loss") and [r.split(",")[0] for r in rows[1:]] == ["4", "8", "8"]
    assert _eval(run, tmp_path / "parts", *FINE_TUNE, "--resume", "--lr", "0.1") == 2
    assert "recipe.base_lr=0.05, this one has recipe.base_lr=0.1" in capsys.readouterr().err


def test_labels_from_scratch_and_the_report(run, tmp_path):
    r = unison.evaluate(str(run), out=str(tmp_path), labels="10%", from_scratch=True, fine_tune=True, epochs=1,
                        train_batch_size=48, threads=1, val_subset=64, linear_epochs=5)
    assert r["labels"] == {"labels": "10%", "images": 144, "of": 1438, "per_class_min": 14, "per_class_max": 15,
                           "seed": 0}
    rows = {row["protocol"]: row for row in r["report"]}
    assert list(rows) == ["knn", "linear-fast", "fine-tune"]
    for row in rows.values():
        assert row["train_images"] == 144 and row["scratch_top1"] is not None
        assert row["gain_top1"] == pytest.approx(row["top1"] - row["scratch_top1"])
    assert rows["fine-tune"]["val_images"] == 64 and rows["fine-tune"]["top5"] >= rows["fine-tune"]["top1"]
    assert [(f["protocol"], f["scratch"], f["steps"]) for f in r["full"]] == [("fine-tune", False, 3),
                                                                             ("fine-tune", True, 3)]
    md = (tmp_path / "eval.md").read_text()
    assert md.startswith("# unison eval: simclr / small_cnn at step 3")
    assert "144 of 1,438 images, 14 to 15 per class, drawn with seed 0" in md and "| fine-tuning: 1 epoch of sgd" in md
    assert json.loads((tmp_path / "eval.json").read_text())["report"] == r["report"]
    again, other = (unison.evaluate(str(run), out=str(tmp_path / f"seed{seed}"), labels="10%", seed=seed,
                                    linear=False, threads=1, val_subset=64) for seed in (0, 1))
    assert again["knn_top1"] == r["knn_top1"]   # the same draw of the labelled images, the same reference set
    assert other["knn_top1"] != r["knn_top1"] and other["labels"]["seed"] == 1   # another draw


def test_the_standard_linear_protocol_trains_the_head_only(run, tmp_path):
    from unison.training.load import load_method

    r = unison.evaluate(str(run), out=str(tmp_path), knn=False, linear_protocol="standard", epochs=1, labels="128",
                        train_batch_size=32, threads=1, val_subset=64)
    full = r["full"][0]
    assert full["protocol"] == "linear" and full["recipe"]["head_norm"] and full["recipe"]["optimizer"] == "sgd"
    assert full["top5"] is not None and [row["protocol"] for row in r["report"]] == ["linear-standard"]
    state = classifier_state(tmp_path / "linear-standard")
    trained = load_method(str(run))[0].backbone.state_dict()
    assert all(torch.equal(state[f"backbone.{k}"], v) for k, v in trained.items())   # weights and statistics
    assert not torch.equal(state["norm.running_mean"], torch.zeros_like(state["norm.running_mean"]))


@pytest.mark.parametrize("argv, message", [
    (["--labels", "10%", "--subset", "100"], "--subset 100 and --labels 10% both choose the training images"),
    (["--resume"], "--resume continues a fine-tuning or standard linear evaluation"),
    (["--labels", "5000"], "--labels 5000 asks for more images than --data digits has (1,438)"),
    (["--labels", "3x"], "--labels '3x' is neither a count"),
    (["--no-knn", "--no-linear"], "nothing to evaluate"),
    (["--no-knn", "--linear-protocol", "standard", "--layer-decay", "0.7"], "keeps frozen"),
    (FINE_TUNE + ["--drop-path", "0.1"], "--drop-path 0.1 needs a transformer backbone"),
    (FINE_TUNE + ["--augmentation", "simclr"], "--augmentation 'simclr' is not a preset of one view"),
    (FINE_TUNE + ["--mixup", "0.8", "--train-batch-size", "33"], "multiple of 2"),
    (FINE_TUNE + ["--labels", "1%"], "--labels 1% gives 14 labelled training images, fewer than one global batch"),
    (FINE_TUNE + ["--world-size", "3"], "--train-batch-size 32 (global) cannot be split evenly over 3 workers"),
])
def test_bad_options_are_one_line(run, tmp_path, capsys, argv, message):
    assert _eval(run, tmp_path, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_new_evaluation_sets_the_earlier_one_aside_and_never_replaces_other_files(run, tmp_path, capsys):
    (tmp_path / "eval.md").write_text("my notes\n")
    assert _eval(run, tmp_path, "--no-linear", *FAST) == 2
    assert "holds files that are not an earlier unison eval's (eval.md); give an empty or new folder" in \
        capsys.readouterr().err
    assert (tmp_path / "eval.md").read_text() == "my notes\n"
    (tmp_path / "eval.md").unlink()
    assert _eval(run, tmp_path, "--no-linear", *FAST) == 0
    first = (tmp_path / "eval.json").read_text()
    assert _eval(run, tmp_path, "--no-linear", *FAST) == 0
    assert "held an earlier evaluation: moved eval.json, eval.md to" in capsys.readouterr().err
    (earlier,) = (tmp_path / "earlier-runs").iterdir()
    assert (earlier / "eval.json").read_text() == first and (tmp_path / "eval.md").read_text().startswith("# unison")
    (tmp_path / "notes.json").write_text("{}")
    assert _eval(run, tmp_path / "again", "--no-linear", *FAST, "--json", str(tmp_path / "notes.json")) == 2
    assert "notes.json already exists; it is left as it is: pass --overwrite" in capsys.readouterr().err
    assert _eval(run, tmp_path / "again", "--no-linear", *FAST, "--json", str(tmp_path / "notes.json"),
                 "--overwrite") == 0
    assert json.loads((tmp_path / "notes.json").read_text())["unison"] == "eval"


# -- with real processes --

TOLERANCE = 1e-9
COMMON = ["--precision", "float64", "--epochs", "2", "--labels", "128", "--train-batch-size", "32", "--val-subset", "64",
          "--threads", "1"]
CASES = {
    "cnn-fine-tune": ("small_cnn", ["--fine-tune", "--no-knn", "--no-linear"]),
    "cnn-standard-linear": ("small_cnn", ["--linear-protocol", "standard", "--no-knn"]),
    "vit-fine-tune-drop-path-layer-decay-mixup-cutmix": ("vit_micro_p2", ["--fine-tune", "--no-knn", "--no-linear",
                                                                          "--mixup", "0.8", "--cutmix", "1.0"]),
    "cnn-fine-tune-streamed-folder": ("small_cnn", ["--fine-tune", "--no-knn", "--no-linear", "--data", "{train}",
                                                    "--val", "{val}", "--data-mode", "stream"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from unison.data.generated import write_image_folder

    root = tmp_path_factory.mktemp("finetune-workers")
    write_image_folder(root / "train", 160, classes=4, sizes=(16, 40), seed=1)   # JPEGs of many sizes, streamed
    write_image_folder(root / "val", 40, classes=4, sizes=(16, 40), seed=2)
    return {**{b: digits_checkpoint(root / b, b) for b in ("small_cnn", "vit_micro_p2")},
            "train": root / "train", "val": root / "val"}


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_two_workers_train_like_one_on_the_global_batch(runs, tmp_path, case):
    backbone, argv = CASES[case]
    argv = [a.format(train=runs["train"], val=runs["val"]) for a in argv]
    for world in (1, 2):
        assert main(["eval", "--checkpoint", str(runs[backbone]), "--out", str(tmp_path / f"w{world}"),
                     "--world-size", str(world), *COMMON, *argv]) == 0
    folder = "fine-tune" if "--fine-tune" in argv else "linear-standard"
    one, two = (classifier_state(tmp_path / f"w{world}" / folder) for world in (1, 2))
    diff, worst = max_rel_difference(two, one)
    assert diff < TOLERANCE, f"{worst}: {diff:.3e}"
    r1, r2 = (json.loads((tmp_path / f"w{world}" / "eval.json").read_text())["full"][0] for world in (1, 2))
    assert (r1["world_size"], r2["world_size"], r1["steps"], r2["steps"]) == (1, 2, 8, 8)
    assert (r1["top1"], r1["top5"]) == (r2["top1"], r2["top5"])
    assert r2["final_loss"] == pytest.approx(r1["final_loss"], rel=1e-9)


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
def test_under_torchrun_every_protocol_runs_in_its_group_and_one_process_reports(runs, tmp_path):
    """torchrun's 2 processes each run ``unison eval``: they join torchrun's group once for both protocols
    (the fine-tuning, then from scratch), train like one process (compared with one, as above), and rank 0
    alone prints and writes the report."""
    argv = ["--checkpoint", str(runs["small_cnn"]), *COMMON, "--fine-tune", "--no-knn", "--no-linear",
            "--from-scratch"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    two = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "unison.cli", "eval", *argv,
                          "--out", str(tmp_path / "w2")], env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("unison eval: simclr / small_cnn") == 1, two.stdout
    assert main(["eval", *argv, "--out", str(tmp_path / "w1")]) == 0
    for folder in ("fine-tune", "fine-tune-scratch"):
        diff, worst = max_rel_difference(classifier_state(tmp_path / "w2" / folder),
                                         classifier_state(tmp_path / "w1" / folder))
        assert diff < TOLERANCE, f"{folder} {worst}: {diff:.3e}"
    full = json.loads((tmp_path / "w2" / "eval.json").read_text())["full"]
    assert [(f["scratch"], f["world_size"]) for f in full] == [(False, 2), (True, 2)]
    refused = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "unison.cli", "eval",
                              *argv, "--world-size", "4", "--out", str(tmp_path / "bad")], env=env,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--world-size 4 but torchrun started 2 worker processes" in refused.stderr
