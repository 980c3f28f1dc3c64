"""Checkpoints of sharded runs (torch.distributed.checkpoint): resume anywhere, export, atomic, safe to load.

Runs use float64: "continues identically" means 1e-9 relative to the uninterrupted run (another
world size sums in another order, so not bit for bit)."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fault_helpers import QUIET
from helpers.dcp_checkpoint import _Payload

from unison.cli import main
from unison.equivalence import assert_states_close
from unison.errors import CheckpointError
from unison.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_non_tensor_entries_with_code_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from unison.training.checkpoint import load_safely

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "lr": 0.5, "hyper": _Payload(marker)}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    assert not marker.exists()
    plain = {"w": torch.zeros(3), "lr": None}
    load_safely(plain, tmp_path / "ckpt")             # tensors and plain values load
    assert plain["lr"] == 0.5 and torch.equal(plain["w"], torch.ones(3))
    with pytest.raises(CheckpointError, match="refusing to load hyper"):
        load_safely({"hyper": None}, tmp_path / "ckpt")
    assert not marker.exists()


# -- with real processes --

TINY = ["--batch-size", "32", "--subset", "256", "--val-subset", "32", "--knn-k", "5", "--no-progress",
        "--precision", "float64", "--log-every", "1", *QUIET]




@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """DINO (teacher, centre), 2 workers, --shard full, 4 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("full") / "run"
    assert main(["train", *TINY, "--method", "dino", "--world-size", "2", "--shard", "full", "--max-steps", "4",
                 "--checkpoint-every", "2", "--out", str(out)]) == 0
    return out


@pytest.mark.distributed
def test_each_rank_writes_its_shards(full_run):
    names = [p.name for p in list_checkpoints(full_run)]
    assert names == ["step_00000002.dcp", "step_00000004.dcp"] and latest_checkpoint(full_run).name == names[-1]
    files = sorted(p.name for p in (full_run / "checkpoints" / names[-1]).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "unison.pt"]


@pytest.mark.distributed
def test_full_sharding_at_w2_resumes_unsharded_at_w1_identically(full_run, tmp_path):
    mid = full_run / "checkpoints" / "step_00000002.dcp"
    out = tmp_path / "w1"
    assert main(["train", "--resume", str(mid), "--world-size", "1", "--shard", "none", "--out", str(out),
                 "--no-progress"]) == 0
    resumed, uninterrupted = load_checkpoint(out), load_checkpoint(full_run)
    assert latest_checkpoint(out).suffix == ".pt" and resumed["world_size"] == 1 and uninterrupted["world_size"] == 2
    assert resumed["config"]["distributed"]["shard"] == "none" and resumed["step"] == uninterrupted["step"] == 4
    state = [k for k in uninterrupted["model"] if "teacher" in k or "center" in k]
    assert state, "no teacher or centre in the state: the test would not cover them"
    assert_states_close(resumed["model"], uninterrupted["model"], tol=1e-9)
    moved = load_checkpoint(mid)["model"]["backbone.features.0.weight"] - uninterrupted["model"]["backbone.features.0.weight"]
    assert moved.abs().max() > 1e-6   # steps 3 and 4 changed the weights: the comparison is not vacuous


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoints_load_into_every_shard_setting(full_run, tmp_path):
    """DCP -> ZeRO-1 at W=2; and a W=1 unsharded .pt checkpoint -> --shard full at W=2."""
    mid = full_run / "checkpoints" / "step_00000002.dcp"
    assert main(["train", "--resume", str(mid), "--world-size", "2", "--shard", "optimizer", "--out",
                 str(tmp_path / "zero"), "--no-progress"]) == 0
    assert_states_close(load_checkpoint(tmp_path / "zero")["model"], load_checkpoint(full_run)["model"], tol=1e-9)

    plain = tmp_path / "plain"
    assert main(["train", *TINY, "--method", "dino", "--world-size", "1", "--max-steps", "4", "--checkpoint-every",
                 "2", "--out", str(plain)]) == 0
    assert main(["train", "--resume", str(plain / "checkpoints" / "step_00000002.pt"), "--world-size", "2",
                 "--shard", "full", "--out", str(tmp_path / "to_full"), "--no-progress"]) == 0
    assert_states_close(load_checkpoint(tmp_path / "to_full")["model"], load_checkpoint(plain)["model"], tol=1e-9)


@pytest.mark.distributed
def test_export_and_eval_read_a_sharded_checkpoint(full_run, tmp_path):
    from unison.evaluation import EvalOptions, evaluate_checkpoint
    from unison.models import build_backbone

    out = tmp_path / "backbone.pt"
    assert main(["export", "--checkpoint", str(full_run), "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    backbone, _ = build_backbone("small_cnn")
    backbone.load_state_dict(exported)   # strict: a plain backbone state dict
    consolidated = load_checkpoint(full_run)["model"]
    for k, v in exported.items():
        assert torch.equal(v, consolidated[f"backbone.{k}"])
    result = evaluate_checkpoint(EvalOptions(checkpoint=str(full_run), linear=False, knn_k=5, device="cpu"))
    assert result["step"] == 4 and 0 <= result["knn_top1"] <= 1


def _copy_checkpoint(full_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run" / "checkpoints" / "step_00000004.dcp"
    shutil.copytree(full_run / "checkpoints" / "step_00000004.dcp", copy)
    return copy


@pytest.mark.distributed
def test_metadata_with_code_is_refused_not_executed(full_run, tmp_path):
    marker = tmp_path / "pwned"
    copy = _copy_checkpoint(full_run, tmp_path)
    (copy / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="refusing to load the DCP metadata: it names posix.mkdir"):
        load_checkpoint(copy)
    assert not marker.exists()


@pytest.mark.distributed
def test_metadata_naming_files_outside_the_checkpoint_is_refused(full_run, tmp_path):
    from unison.training.checkpoint import read_metadata_safely

    copy = _copy_checkpoint(full_run, tmp_path)
    metadata = read_metadata_safely(copy)
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file in"):
        load_checkpoint(copy)


# ------------------------------------------------------------------ atomic at the directory level
@pytest.mark.distributed
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save interrupted after the shards are written, before the rename: latest stays the previous one."""
    import unison.training.checkpoint.dcp as dcp_checkpoint

    run = tmp_path / "run"
    common = ["train", *TINY, "--method", "moco", "--param", "queue_size=64", "--world-size", "1", "--shard",
              "full", "--max-steps", "4", "--checkpoint-every", "2", "--out", str(run)]
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "step_00000004.dcp":
            raise KeyboardInterrupt   # stands in for a kill between writing and renaming
        return real_replace(src, dst)

    monkeypatch.setattr(dcp_checkpoint.os, "replace", replace)
    assert main(common) == 130
    assert latest_checkpoint(run).name == "step_00000002.dcp" and load_checkpoint(run)["step"] == 2
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".step_00000004.dcp.")

    monkeypatch.setattr(dcp_checkpoint.os, "replace", real_replace)
    assert main([*common, "--resume", "auto"]) == 0
    assert load_checkpoint(run)["step"] == 4
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]


# A writer that saves DCP checkpoints of a 16 MB model in a loop until the test SIGKILLs it.
_WRITER = """
import sys, types, torch
from unison.config import TrainConfig
from unison.training.checkpoint import save_sharded
model = torch.nn.Linear(2000, 2000)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(1, 2000)).sum().backward(); opt.step()
run = types.SimpleNamespace(method=model, optimizer=opt, cfg=TrainConfig(keep_checkpoints=2), resolved={})
step = int(sys.argv[2])
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step)
    save_sharded(run, sys.argv[1], step, {"check": step})
    print(f"saved {step}", flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_sharded_saves_leaves_a_loadable_latest(tmp_path):
    last, mid_save = 0, 0
    for delay in (0.05, 0.2, 0.45):
        writer = subprocess.Popen([sys.executable, "-W", "ignore", "-c", _WRITER, str(tmp_path), str(last)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert writer.stdout.readline().startswith("saved"), writer.stderr.read()
            time.sleep(delay)
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=60)
        finally:
            writer.kill()
            writer.stdout.close()
            writer.stderr.close()
        mid_save += any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())
        ckpt = load_checkpoint(tmp_path)
        assert ckpt["step"] > last and ckpt["history"]["check"] == ckpt["step"]
        assert torch.all(ckpt["model"]["weight"] == ckpt["step"])
        for path in list_checkpoints(tmp_path):   # everything under a final name is complete
            assert load_checkpoint(path)["step"] == int(path.stem.split("_")[1])
        last = ckpt["step"]
    print(f"{mid_save} of 3 kills left a half-written checkpoint directory")


@pytest.mark.distributed
def test_a_sharded_run_is_a_teacher_with_its_dino_head(full_run, tmp_path):
    """--teacher of a --shard full run (.dcp): consolidated in the pre-flight and by every worker (a collective
    read), its backbone and DINO head taken as the run saved them."""
    out = tmp_path / "student"
    assert main(["train", *TINY, "--method", "distill", "--teacher", str(full_run), "--param", "loss=dino",
                 "--world-size", "2", "--max-steps", "1", "--no-random-init-knn", "--out", str(out)]) == 0
    student, dino = load_checkpoint(out)["model"], load_checkpoint(full_run)["model"]
    taken = {k[len("teacher."):]: v for k, v in student.items() if k.startswith("teacher.")}
    assert {k.split(".")[0] for k in taken} == {"backbone", "head"}
    for k, v in taken.items():   # the dense wrapper of the teacher's backbone may nest its names
        source = k if k in dino else k.replace("backbone.net.", "backbone.")
        assert torch.equal(v, dino[source]), k
