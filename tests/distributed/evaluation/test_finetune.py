"""``unison eval --fine-tune`` and ``--linear-protocol standard`` on 2 real worker processes (gloo on loopback, each
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
from helpers.finetune import classifier_state, digits_checkpoint, max_rel_difference

from unison.cli import main

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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src"),
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
