"""``unison train --method distill``: the teacher options end to end in this process (world size 1), and every bad
teacher input as one line with its exit code (the `_run`/`_log` pattern of tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fault_helpers import error_line, run_cli

from unison.cli import main

# world size 1 runs in this process (no worker processes); "train" leads the list
TRAIN = ["train"]
TINY = ["--world-size", "1", "--max-steps", "1", "--no-progress", "--batch-size", "16", "--subset", "32",
        "--val-subset", "32", "--knn-k", "5", "--no-random-init-knn", "--signal-images", "0", "--logger", "none"]


def _run(argv: list[str], capfd) -> tuple[int, str]:
    return run_cli([*TRAIN, *argv], capfd)


def _line(err: str) -> str:
    return error_line(err, ("unison: error:", "unison train: error:"))


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> Path:
    """A distilled run from a random-init teacher (itself the teacher of the other tests)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    assert main([*TRAIN, "--method", "distill", "--teacher", "random", "--out", str(out), *TINY]) == 0
    return out


def test_a_run_distils_from_a_unison_run_pinned_to_its_checkpoint(teacher_run, tmp_path, capfd):
    out = tmp_path / "student"
    code, err = _run(["--method", "distill", "--teacher", str(teacher_run), "--out", str(out), *TINY], capfd)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["teacher"].startswith(str(teacher_run / "checkpoints" / "step_")) and cfg["teacher_backbone"] == "small_cnn"
    assert cfg["method_params"]["queue_size"] == 16   # LightlyTrain's rule for the 32 training images, recorded
    (teacher_run / "checkpoints" / "latest").rename(teacher_run / "latest.bak")   # the teacher out of reach:
    try:                                                                          # its copy is in the checkpoint
        assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "s.pt")]) == 0
    finally:
        (teacher_run / "latest.bak").rename(teacher_run / "checkpoints" / "latest")


def test_loss_dino_distils_through_a_dino_runs_head_kept_in_the_checkpoint(tmp_path, capfd):
    """--param loss=dino from a DINO run: its (backbone, head) pair loaded and frozen, the head's shape recorded,
    so the student's checkpoint rebuilds (export) without the teacher."""
    from unison.training.checkpoint.files import latest_checkpoint
    from unison.training.checkpoint.safe_load import load_file

    teacher, out = tmp_path / "dino", tmp_path / "student"
    assert main([*TRAIN, "--method", "dino", "--out", str(teacher), *TINY]) == 0
    code, err = _run(["--method", "distill", "--teacher", str(teacher), "--param", "loss=dino", "--out", str(out),
                      *TINY], capfd)
    assert code == 0, err
    params = json.loads((out / "config.json").read_text())["method_params"]
    assert (params["loss"], params["out_dim"], params["head_layers"]) == ("dino", 1024, 2)   # DINO's default head
    mine, theirs = (load_file(latest_checkpoint(run))["model"] for run in (out, teacher))
    assert all(torch.equal(mine[f"teacher.{k}"], v) for k, v in theirs.items() if k.startswith(("head.", "backbone.")))
    (teacher / "checkpoints").rename(tmp_path / "away")   # the teacher out of reach: eval/export need it not
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "s.pt")]) == 0


CASES = [
    ("no-teacher", ["--method", "distill"], 2, "--method distill needs --teacher"),
    ("teacher-for-simclr", ["--method", "simclr", "--teacher", "random"], 2, "--teacher is for --method distill"),
    ("teacher-missing", ["--method", "distill", "--teacher", "{tmp}/nowhere"], 4, "does not exist"),
    ("weights-without-backbone", ["--method", "distill", "--teacher", "{tmp}/w.pth"], 2,
     "is a weights file: give its architecture with --teacher-backbone"),
    ("unknown-teacher-backbone", ["--method", "distill", "--teacher", "random", "--teacher-backbone", "resnet19"], 2,
     "--teacher-backbone 'resnet19' is unknown (did you mean"),
    ("teacher-dtype", ["--method", "distill", "--teacher", "random", "--teacher-dtype", "fp8"], 2, "fp8"),
    ("out-in-teacher", ["--method", "distill", "--teacher", "{run}", "--out", "{run}/sub"], 2, "overlap"),
    ("other-teacher-backbone", ["--method", "distill", "--teacher", "{run}", "--teacher-backbone", "resnet50"], 2,
     "is not the backbone of the teacher run"),
    ("damaged-teacher", ["--method", "distill", "--teacher", "{tmp}/checkpoints/step_00000001.pt"], 4, "step_00000001"),
    ("teacher-weights-mismatch", ["--method", "distill", "--teacher", "{tmp}/foo.pth", "--teacher-backbone",
                                  "small_cnn"], 4, "none of its 1 tensors (foo, ...) is a tensor of the backbone"),
    ("bad-loss", ["--method", "distill", "--teacher", "random", "--param", "loss=l1"], 2, "loss='l1' is unknown"),
    ("dino-loss-headless-run", ["--method", "distill", "--teacher", "{run}", "--param", "loss=dino"], 2,
     "is a distill run without one; give a unison run of --method dino or ibot"),
    ("dino-loss-weights-file", ["--method", "distill", "--teacher", "{tmp}/foo.pth", "--teacher-backbone", "small_cnn",
                                "--param", "loss=dino"], 2, "is a weights file without one"),
    ("dino-loss-head-param", ["--method", "distill", "--teacher", "random", "--param", "loss=dino", "--param",
                              "out_dim=7"], 2, "--param out_dim=7 is not the teacher head's (1024)"),
]


@pytest.mark.parametrize("case_id, argv, code, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_teacher_inputs_are_one_line(case_id, argv, code, fragment, teacher_run, tmp_path, capfd):
    (tmp_path / "w.pth").write_bytes(b"not read")
    torch.save({"foo": torch.zeros(3)}, tmp_path / "foo.pth")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000001.pt").write_bytes(b"garbage")
    before = sorted(p.name for p in teacher_run.rglob("*"))
    argv = [a.format(tmp=tmp_path, run=teacher_run) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    got, err = _run([*argv, *TINY], capfd)
    line = _line(err)
    assert got == code and fragment in line, line
    assert sorted(p.name for p in teacher_run.rglob("*")) == before   # the teacher run is left as it was


def test_a_weights_file_teacher_holds_the_files_tensors(tmp_path):
    from unison.config import TrainConfig
    from unison.models import build_backbone
    from unison.training.teacher import build_teacher

    torch.manual_seed(1)
    net, _ = build_backbone("small_cnn")
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "t.pth")
    cfg = TrainConfig(method="distill", teacher=str(tmp_path / "t.pth"), teacher_backbone="small_cnn")
    got, dim, head = build_teacher(cfg, 16)
    assert head is None
    assert dim == 128 and all(torch.equal(got.state_dict()[k], v) for k, v in net.state_dict().items())


def test_unison_check_gives_distill_a_random_teacher_and_refuses_a_teacher_for_others():
    from unison.config.check import CheckSpec
    from unison.equivalence.steps import train_config_for
    from unison.errors import ConfigError
    from unison.training.resolve import validate_run

    cfg = validate_run(train_config_for(CheckSpec(method="distill"), 2))
    assert (cfg.teacher, cfg.teacher_backbone) == ("random", "small_cnn")
    with pytest.raises(ConfigError, match="--teacher-backbone is for --method distill"):
        validate_run(train_config_for(CheckSpec(method="simclr", teacher_backbone="vit_nano_p2"), 2))


# ------------------------------------------------------------------ resuming a distilled run
def _teacher_of(run: Path) -> dict[str, torch.Tensor]:
    from unison.training.checkpoint.files import latest_checkpoint
    from unison.training.checkpoint.safe_load import load_file

    return {k: v for k, v in load_file(latest_checkpoint(run))["model"].items() if k.startswith("teacher.")}


@pytest.fixture
def student(teacher_run, tmp_path) -> tuple[Path, Path]:
    """(a student distilled for 1 step from a copy of `teacher_run`, that copy)."""
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_run, teacher)
    (teacher / ".unison.lock").unlink(missing_ok=True)
    out = tmp_path / "student"
    assert main([*TRAIN, "--method", "distill", "--teacher", str(teacher), "--out", str(out), *TINY]) == 0
    return out, teacher


def test_resuming_with_another_teacher_is_refused(student, capfd):
    out, teacher = student
    recorded = json.loads((out / "config.json").read_text())["teacher"]
    code, err = _run(["--method", "distill", "--teacher", "random", "--resume", str(out), *TINY, "--max-steps", "2"],
                     capfd)
    assert code == 2 and (f"--teacher random is not the teacher of the run resumed from {out} ({recorded}, whose "
                          "weights its checkpoint holds): a resumed run keeps its teacher") in _line(err), err
    assert json.loads((out / "config.json").read_text())["teacher"] == recorded   # as it was
    # the teacher it was distilled from, named as at the start (the run directory), is its teacher
    code, err = _run(["--method", "distill", "--teacher", str(teacher), "--resume", str(out), *TINY,
                      "--max-steps", "2"], capfd)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["teacher"] == recorded


@pytest.mark.parametrize("how", ["same-teacher-given", "teacher-left-out", "resume-auto", "slurm-requeue"])
def test_resuming_needs_not_the_teacher_file(student, how, tmp_path, capfd, monkeypatch):
    """The checkpoint holds the teacher's weights: a resume reads them there, so the teacher run may be gone."""
    out, teacher = student
    recorded, before = json.loads((out / "config.json").read_text())["teacher"], _teacher_of(out)
    teacher.rename(tmp_path / "gone")
    resume = {"same-teacher-given": ["--teacher", str(teacher), "--resume", str(out)],
              "teacher-left-out": ["--resume", str(out)],
              "resume-auto": ["--teacher", str(teacher), "--resume", "auto", "--out", str(out)],
              "slurm-requeue": ["--teacher", str(teacher), "--out", str(out)]}[how]   # the same command again
    if how == "slurm-requeue":
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    code, err = _run(["--method", "distill", *resume, *TINY, "--max-steps", "2"], capfd)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["teacher"] == recorded
    after = _teacher_of(out)
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
