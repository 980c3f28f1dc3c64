"""What `unison train` writes and prints, as a user starts it: one real 2-worker run (a subprocess, shared by the checks
that read its output) for config.json, the export, the train log and leaked semaphores; torchrun started for real;
the loggers (none, wandb), timm's settings reaching the model, the random-init kNN skipped."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from unison.cli import main
from unison.cli.train_args import parse_train_args

TINY = ["--no-progress", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5"]


W1 = ["--world-size", "1", "--max-steps", "2", *TINY]


TORCHRUN = Path(sys.executable).with_name("torchrun")


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "UNISON_NO_CACHE": "1"}


def _unison(*argv: str, cwd: Path | None = None, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unison.cli", *argv], env=_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`unison train` with 2 workers and the progress bar on, as a user runs it (3 steps)."""
    out = tmp_path_factory.mktemp("front") / "run"
    argv = [a for a in TINY if a != "--no-progress"]
    proc = _unison("train", "--world-size", "2", "--max-steps", "3", *argv, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.distributed
def test_config_json_holds_the_resolved_values(two_workers):
    out, _ = two_workers
    config = json.loads((out / "config.json").read_text())
    assert config["lr"] is None and config["optimizer"] is None          # as given: the recipe's
    r = config["resolved"]
    assert (r["optimizer"], r["lr"], r["weight_decay"], r["augmentation"]) == ("sgd", 0.12, 5e-4, "digits")
    assert r["peak_lr"] == pytest.approx(0.12 * 32 / 256)                  # after batch scaling
    assert (r["global_batch"], r["world_size"], r["image_size"], r["total_steps"]) == (32, 2, 16, 3)
    assert r["method_params"] == {"temperature": 0.5, "proj_hidden_dim": 512, "proj_dim": 128}
    assert len(r["mean"]) == 3 and len(r["std"]) == 3 and all(0 < s < 1 for s in r["std"])


@pytest.mark.distributed
def test_export_carries_its_preprocessing_and_a_normal_file_mode(two_workers, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from unison.training.checkpoint import load_checkpoint

    out, _ = two_workers
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    ckpt = load_checkpoint(out)
    assert ckpt["resolved"]["mean"] == resolved["mean"] and ckpt["resolved"]["image_size"] == 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean"] == resolved["mean"] and summary["std"] == resolved["std"]
    for name in ("backbone.pt", "weights.safetensors"):   # two stems: one sidecar each
        assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / name)]) == 0
        sidecar = json.loads((tmp_path / name).with_suffix(".json").read_text())
        assert (sidecar["image_size"], sidecar["mean"], sidecar["std"]) == (16, resolved["mean"], resolved["std"])
        assert sidecar["file"] == name and sidecar["method"] == "simclr"
    with safe_open(str(tmp_path / "weights.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["mean"]) == resolved["mean"] and json.loads(meta["image_size"]) == 16
    umask = os.umask(0)
    os.umask(umask)
    modes = {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("backbone.pt", "weights.safetensors")}
    assert modes == {"backbone.pt": 0o666 & ~umask, "weights.safetensors": 0o666 & ~umask}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not TORCHRUN.exists() and not shutil.which("torchrun"), reason="torchrun is not installed")
def test_torchrun_prints_the_result_once_and_refuses_another_world_size(tmp_path):
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else "torchrun"
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    base = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "unison.cli", "train", "--max-steps", "2", *TINY]
    ok = subprocess.run([*base, "--out", str(tmp_path / "ok")], env=env, capture_output=True, text=True, timeout=400)
    assert ok.returncode == 0, ok.stderr[-3000:]
    results = [line for line in ok.stdout.splitlines() if line.startswith("simclr x2 workers, 2 steps")]
    assert len(results) == 1, ok.stdout
    bad = subprocess.run([*base, "--world-size", "4", "--out", str(tmp_path / "bad")], env=env, capture_output=True,
                         text=True, timeout=400)
    assert bad.returncode != 0
    # Every rank refuses it; whichever exits first, torchrun ends the other (SIGTERM) before it may print.
    assert re.search(r"unison: error: rank [01]: --world-size 4 but torchrun started 2 worker processes; the launcher "
                     r"decides the world size", bad.stderr), bad.stderr[-3000:]
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.distributed
def test_no_leaked_semaphore_after_a_multi_worker_run(two_workers):
    _, proc = two_workers
    assert "simclr x2:" in proc.stderr                            # the progress bar was drawn
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
    assert "resource_tracker" not in proc.stderr


def test_logger_none_writes_no_metrics_and_tensorboard_is_not_implied(tmp_path, capsys):
    assert main(["train", *W1, "--logger", "none", "--out", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none" / "metrics.csv").exists() and not (tmp_path / "none" / "plot.png").exists()
    assert (tmp_path / "none" / "summary.json").exists()
    assert main(["train", *W1, "--out", str(tmp_path / "csv")]) == 0
    assert (tmp_path / "csv" / "metrics.csv").exists() and not (tmp_path / "csv" / "tensorboard").exists()


def test_logger_wandb_logs_through_wandb(tmp_path, monkeypatch):
    import importlib.machinery
    import types

    calls: list[tuple] = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, dict(values)))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert main(["train", *W1, "--logger", "wandb", "--out", str(tmp_path / "w")]) == 0
    assert calls[0][0] == "init" and calls[0][1]["config"]["method"] == "simclr"
    assert any(c[0] == "log" and "loss" in c[2] for c in calls) and calls[-1] == ("finish",)


def test_logger_wandb_without_wandb_is_one_line(capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # as if not installed
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    assert main(["train", *W1, "--logger", "wandb"]) == 2
    assert (f"--logger wandb needs the wandb package: {sys.executable} -m pip install 'wandb>=0.16'"
            in capfd.readouterr().err)


def test_timm_settings_and_image_size_reach_the_model(capfd):
    pytest.importorskip("timm")
    import torch

    from unison.models import build_backbone

    net, dim = build_backbone("timm:vit_tiny_patch16_224", image_size=32,
                              backbone_args={"patch_size": 8, "drop_path_rate": 0.1})
    assert net.patch_embed.img_size == (32, 32) and net.patch_embed.patch_size == (8, 8)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, dim)
    cfg = parse_train_args(["--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32",
                            "--backbone-arg", "drop_path_rate=0.1"])
    assert cfg.backbone_args == {"drop_path_rate": 0.1}
    capfd.readouterr()
    for argv, message in ((["--backbone", "timm:vit_tiny_patch16_2244"],
                           "timm has no model 'vit_tiny_patch16_2244' (did you mean 'vit_tiny_patch16_224'?)"),
                          (["--backbone", "timm:vit_tiny_patch16_224", "--backbone-arg", "bogus=1"],
                           "timm model 'vit_tiny_patch16_224' cannot be built with bogus=1: TypeError: ")):
        assert main(["train", *argv]) == 2
        err = capfd.readouterr().err
        assert f"unison: error: {message}" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_the_random_init_knn_can_be_skipped(tmp_path, capsys):
    assert main(["train", *W1, "--no-random-init-knn", "--out", str(tmp_path / "r")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "kNN top-1" in line and "random init" not in line
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["random_init_knn_top1"] is None
    # resumed without the switch: the baseline is not measured on the trained encoder and called random init
    assert main(["train", "--resume", str(tmp_path / "r"), "--max-steps", "3", "--no-progress"]) == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["random_init_knn_top1"] is None


@pytest.mark.distributed
def test_loss_from_the_first_step_and_a_train_log(two_workers):
    out, proc = two_workers
    assert re.search(r"\bloss \d", proc.stderr)   # the bar shows a loss ("..., loss 4.0027, ...")
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert rows[0]["step"] == "0" and rows[0]["rankme"] and not rows[0]["loss"]   # the random init's signals
    assert next(r for r in rows if r["loss"])["step"] == "1"                   # step 1's loss is logged
    log = (out / "train.log").read_text().splitlines()
    assert "simclr x2 workers on digits, starting: 3 steps" in log[0]
    assert any("step 1/3 (epoch " in line and ": loss " in line for line in log)
    assert any("random-init kNN top-1" in line for line in log)
    result = proc.stdout.strip().splitlines()[-1]
    assert log[-1].endswith(result)                                            # the line the console ended with


def test_train_log_records_an_error_of_a_started_run(tmp_path, capsys):
    out = tmp_path / "diverged"
    assert main(["train", *W1, "--lr", "1e30", "--max-steps", "4", "--out", str(out)]) == 5
    assert "unison: error: non-finite loss" in (out / "train.log").read_text().splitlines()[-1]
