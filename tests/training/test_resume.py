"""Resume: an interrupted run continued from its last checkpoint ends exactly where an uninterrupted one does.

The checkpoint carries the model (with momentum encoders, queues and centres, which are in the
method's state_dict), the optimizer (ZeRO-1 shards consolidated), the step (from which the learning
rate and the data position are derived) and the RNG state. Runs use float64, so "the same" means
1e-9 relative. Interruptions come from the testing-only ``UNISON_FAULT_INJECT`` hook.

Which checkpoint a resume continues: the run's own (its run id, its step under its own name, a file, not a link),
and only on the same walk through the data; everything else is refused in one line before anything moves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from fault_helpers import error_line, run_cli

from unison.cli import main
from unison.equivalence import assert_states_close
from unison.training.checkpoint import load_checkpoint
from unison.training.owner import LOCK_NAME

FAULT = "UNISON_FAULT_INJECT"


TINY = ["--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--precision", "float64", "--max-steps", "4", "--checkpoint-every", "2", "--log-every", "1"]


pytestmark = [pytest.mark.distributed,   # runs, through helpers the conftest does not read
              pytest.mark.usefixtures("run_env")]   # tests/conftest.py: no image cache, no fault, not a restart


# DINOv3: its Gram teacher loaded at step 1 and never refreshed, so the resumed steps 3 and 4 anchor to the snapshot
# the step-2 checkpoint holds
PARAMS = {"dinov3": ["--param", "gram_start_fraction=0.25", "--param", "gram_refreshes=0"]}


@pytest.mark.parametrize("method, how", [("moco", "resume-auto"), ("dino", "torchrun-restart"), ("dinov3", "resume-auto")])
def test_interrupted_run_resumes_to_the_uninterrupted_result(method, how, tmp_path, monkeypatch):
    common = ["train", *TINY, "--world-size", "1", "--method", method, *PARAMS.get(method, [])]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main([*common, "--out", str(ref)]) == 0

    monkeypatch.setenv(FAULT, "rank=0,step=3,kind=nan")  # fails at step 3, after the step-2 checkpoint
    assert main([*common, "--resume", "auto", "--out", str(run)]) == 5  # auto: nothing to resume, a fresh run
    assert load_checkpoint(run)["step"] == 2
    if how == "resume-auto":
        monkeypatch.delenv(FAULT)
        assert main([*common, "--resume", "auto", "--out", str(run)]) == 0
    else:  # what torchrun does: the same command again, with TORCHELASTIC_RESTART_COUNT=1 and no --resume
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the fault fires in attempt 0 only
        assert main([*common, "--out", str(run)]) == 0

    final, expected = load_checkpoint(run), load_checkpoint(ref)
    assert final["step"] == expected["step"] == 4
    buffers = [k for k in expected["model"] if "queue" in k or "center" in k or "teacher" in k or "momentum" in k]
    assert buffers, "no momentum encoder, queue or centre in the state: the test would not cover them"
    if method == "dinov3":
        assert int(expected["model"]["gram_loads"]) == 1 and any(k.startswith("gram_teacher.") for k in buffers)
    assert_states_close(final["model"], expected["model"], where="model")
    assert_states_close(final["optimizer"], expected["optimizer"], where="optimizer")
    assert_states_close(final["history"]["random_init_knn_top1"], expected["history"]["random_init_knn_top1"])


@pytest.mark.slow
def test_sharded_optimizer_state_resumes_at_another_world_size(tmp_path):
    """ZeRO-1 at W=2: the checkpoint holds the consolidated state, which a W=1 run continues exactly."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *TINY, "--shard-optimizer", "--out", str(a)]) == 0
    mid = a / "checkpoints" / "step_00000002.pt"
    assert main(["train", "--resume", str(mid), "--world-size", "1", "--out", str(b), "--no-progress"]) == 0
    full, resumed = load_checkpoint(a), load_checkpoint(b)
    assert resumed["step"] == full["step"] == 4 and resumed["world_size"] == 1 and full["world_size"] == 2
    assert_states_close(resumed["model"], full["model"], where="model")
    assert_states_close(resumed["optimizer"], full["optimizer"], where="optimizer")


# ------------------------------------------------------------------ which checkpoint a resume continues
SHORT = ["train", *TINY, "--world-size", "1", "--max-steps", "2", "--checkpoint-every", "1", "--signal-images", "0",
         "--no-random-init-knn", "--no-knn"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> dict[str, Path]:
    """Two 2-step runs, a checkpoint at every step: seed 0 and seed 1."""
    root = tmp_path_factory.mktemp("two_runs")
    for name, seed in (("a", "0"), ("b", "1")):
        assert main([*SHORT, "--seed", seed, "--out", str(root / name)]) == 0
    return {"a": root / "a", "b": root / "b"}


def _copy_run(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    (to / LOCK_NAME).unlink(missing_ok=True)
    return to


def _run_id(run: Path) -> str:
    return json.loads((run / "config.json").read_text())["resolved"]["run_id"]


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p).encode()
            for p in sorted(run.rglob("*")) if p.name not in ("train.log", LOCK_NAME) and not p.is_dir()}


def test_a_run_keeps_its_id_when_it_continues_and_a_branch_gets_its_own(two_runs, tmp_path):
    run = _copy_run(two_runs["a"], tmp_path / "run")
    first = _run_id(run)
    assert first != _run_id(two_runs["b"]) and first.isalnum()
    assert load_checkpoint(run)["resolved"]["run_id"] == first
    assert json.loads((run / "summary.json").read_text())["run_id"] == first
    assert main([*SHORT, "--max-steps", "3", "--resume", "auto", "--out", str(run)]) == 0
    assert _run_id(run) == first and load_checkpoint(run)["resolved"]["run_id"] == first
    branch = tmp_path / "branch"
    assert main([*SHORT, "--max-steps", "3", "--resume", str(run / "checkpoints" / "step_00000002.pt"),
                 "--out", str(branch)]) == 0
    assert _run_id(branch) not in (first, None) and load_checkpoint(branch)["resolved"]["run_id"] == _run_id(branch)


def test_another_runs_checkpoint_copied_in_as_the_latest_is_refused_and_nothing_moves(two_runs, tmp_path, capfd):
    run = _copy_run(two_runs["a"], tmp_path / "run")
    shutil.copy(two_runs["b"] / "checkpoints" / "step_00000002.pt", run / "checkpoints" / "step_00000002.pt")
    before = _files(run)
    code, err = run_cli([*SHORT, "--max-steps", "3", "--resume", "auto", "--out", str(run)], capfd)
    assert code == 4, err
    line = error_line(err)
    assert (f"checkpoint {run / 'checkpoints' / 'step_00000002.pt'} is of another run (run id "
            f"{_run_id(two_runs['b'])}, seed 1) than the run in {run} (run id {_run_id(run)}, seed 0, its "
            f"config.json): it was copied in; move it out of {run / 'checkpoints'}") in line, line
    assert _files(run) == before and not (run / "earlier-runs").exists()


def test_checkpoints_from_before_run_ids_still_resume(two_runs, tmp_path):
    run = _copy_run(two_runs["a"], tmp_path / "run")
    for path in (run / "checkpoints").glob("step_*.pt"):   # as written before run ids were recorded
        ckpt = torch.load(path, weights_only=True)
        del ckpt["resolved"]["run_id"], ckpt["unison_version"]
        torch.save(ckpt, path)
    config = json.loads((run / "config.json").read_text())
    del config["resolved"]["run_id"]
    (run / "config.json").write_text(json.dumps(config))
    assert main([*SHORT, "--max-steps", "3", "--resume", "auto", "--out", str(run)]) == 0
    assert load_checkpoint(run)["step"] == 3 and load_checkpoint(run)["resolved"]["run_id"] == _run_id(run)


def test_a_checkpoint_named_for_another_step_is_refused(two_runs, tmp_path, capfd):
    run = _copy_run(two_runs["a"], tmp_path / "run")
    ckpts = run / "checkpoints"
    (ckpts / "step_00000001.pt").rename(ckpts / "step_00000005.pt")   # step 1 under a later step's name
    (ckpts / "latest").write_text("step_00000005.pt\n")
    for resume in ("auto", str(ckpts / "step_00000005.pt")):
        code, err = run_cli([*SHORT, "--max-steps", "6", "--resume", resume, "--out", str(run)], capfd)
        assert code == 4, err
        assert (f"checkpoint {ckpts / 'step_00000005.pt'} is named step 5 but holds step 1 (its header): it was "
                "renamed, or copied in from another run; name it step_00000001.pt, or move it out of") in err, err
    assert not (run / "earlier-runs").exists()


@pytest.mark.parametrize("target", ["another-run", "this-run"])
def test_a_link_as_the_latest_checkpoint_is_refused_and_the_run_stays(two_runs, target, tmp_path, capfd):
    run = _copy_run(two_runs["a"], tmp_path / "run")
    ckpts = run / "checkpoints"
    pointed = two_runs["b"] / "checkpoints" / "step_00000002.pt" if target == "another-run" else Path("step_00000002.pt")
    (ckpts / "step_00000009.pt").symlink_to(pointed)
    (ckpts / "latest").write_text("step_00000009.pt\n")
    before = _files(run)
    for _ in range(2):   # the same command again: the same line, never a fresh run
        code, err = run_cli([*SHORT, "--max-steps", "10", "--resume", "auto", "--out", str(run)], capfd)
        assert code == 4, err
        assert (f"unison: error: {ckpts / 'step_00000009.pt'} is a symbolic link (to {pointed}); a run's checkpoints "
                "are its own files") in err, err
        assert _files(run) == before and not (run / "earlier-runs").exists()


@pytest.mark.parametrize("flag, value, saved", [("--batch-size", "32", "64"), ("--seed", "3", "0"),
                                                ("--grad-sync-every", "2", "1"), ("--subset", "128", "256")])
def test_a_resume_that_would_walk_the_data_otherwise_is_refused(two_runs, flag, value, saved, tmp_path, capfd):
    """Another global batch, accumulation, seed or subset would go on from the same step on another walk through the
    data (images of the epoch skipped, the learning rate scaled to the new batch): refused, like another
    --time-budget; the same value resumes."""
    run = _copy_run(two_runs["a"], tmp_path / "run")
    before = _files(run)
    code, err = run_cli([*SHORT, "--max-steps", "3", "--resume", "auto", flag, value, "--out", str(run)], capfd)
    assert code == 4, err
    assert (f"was trained with {flag} {saved}, this run has {flag} {value}: a resumed run keeps the images of each "
            f"step and their order") in error_line(err), err
    assert f"resume with {flag} {saved}" in err and _files(run) == before


# ------------------------------------------------------------------ run directories of earlier code
EARLIER_RUNS = Path(__file__).resolve().parents[1] / "data" / "run_dirs"
EARLIER_ARGS = ["train", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
                "--world-size", "1", "--checkpoint-every", "2", "--signal-images", "0", "--no-random-init-knn",
                "--no-knn", "--param", "proj_hidden_dim=64", "--param", "proj_dim=32"]


@pytest.mark.parametrize("name", sorted(p.name for p in EARLIER_RUNS.iterdir() if p.is_dir()))
def test_a_run_directory_written_by_earlier_code_resumes_where_it_stopped(name, tmp_path):
    """A run directory kept from an earlier version (moved since: its config.json names another folder) continues
    as the same run: from its step, under its run id, nothing set aside, config.json keeping every key it had."""
    run = _copy_run(EARLIER_RUNS / name, tmp_path / "run")
    before = json.loads((run / "config.json").read_text())
    step = load_checkpoint(run)["step"]
    assert main([*EARLIER_ARGS, "--max-steps", str(step + 1), "--resume", "auto", "--out", str(run)]) == 0
    after = load_checkpoint(run)
    assert after["step"] == step + 1 and after["resolved"]["run_id"] == before["resolved"]["run_id"]
    assert not (run / "earlier-runs").exists()
    config = json.loads((run / "config.json").read_text())
    assert set(before) <= set(config) and set(before["resolved"]) <= set(config["resolved"])
