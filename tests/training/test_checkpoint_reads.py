"""How often a checkpoint is read: the header alone where that is enough, the full state once per resume.

The CLI (the resumed run's options) and the pre-flight checks (exists, intact, safe, same method) need only
a checkpoint's header; a ``.dcp`` directory's header is read without building a model or touching a shard.
The worker reads the full state once. Both kinds carry the same header, ``extra`` included."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from fault_helpers import QUIET
from helpers.dcp_checkpoint import small_sharded_checkpoint

import unison.cli.train_args
import unison.training.checkpoint.dcp_read as dcp_io
import unison.training.step
from unison.cli import main
from unison.config import TrainConfig
from unison.errors import CheckpointError
from unison.training.checkpoint import (
    FORMAT,
    load_checkpoint,
    read_header,
    save_checkpoint,
)

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def _sharded_checkpoint(run_dir: Path, step: int = 3) -> Path:
    return small_sharded_checkpoint(run_dir, step, {"scaler": {"per_rank": False, "world_size": 1,
                                                               "state": {"scale": 2.0}}})


def _refuse(*args, **kwargs):
    raise AssertionError("a header read must not build a model or read the shards")


def test_header_of_a_dcp_checkpoint_builds_no_model_and_reads_no_shard(tmp_path, monkeypatch):
    path = _sharded_checkpoint(tmp_path)
    monkeypatch.setattr(unison.training.step, "build_method", _refuse)
    monkeypatch.setattr(dcp_io, "load_safely", _refuse)
    monkeypatch.setattr(dcp_io.dcp, "load", _refuse)
    for source in (path, tmp_path, tmp_path / "checkpoints"):
        header = read_header(source, expect_method="byol")
        assert (header.path, header.method, header.step, header.version) == (path, "byol", 3, 1)
        assert header.config == TrainConfig(method="byol", keep_checkpoints=2).to_dict()
    with pytest.raises(CheckpointError, match="was written by method 'byol', this run is 'moco'"):
        read_header(tmp_path, expect_method="moco")


def test_header_read_refuses_another_backbone(tmp_path):
    # was found by the worker: "checkpoint does not match the model: 120 missing keys (...); 24 unexpected keys"
    from unison.training.checkpoint.header import structure

    cfg = TrainConfig(method="byol", backbone="small_cnn")
    save_checkpoint(tmp_path / "pt", {"method": "byol", "config": cfg.to_dict(), "model": {}}, 1)
    assert load_checkpoint(tmp_path / "pt", expect_method=structure(cfg))["step"] == 1
    for field, value, shown in (("backbone", "resnet18", "--backbone small_cnn, this run has --backbone resnet18"),
                                ("backbone_args", {"depth": 2}, "no --backbone-arg, this run has --backbone-arg depth=2")):
        other = TrainConfig(method="byol", **{"backbone": "small_cnn", field: value})
        with pytest.raises(CheckpointError, match="was trained with " + shown):
            load_checkpoint(tmp_path / "pt", expect_method=structure(other))


def test_header_read_refuses_what_a_full_load_refuses(tmp_path):
    path = _sharded_checkpoint(tmp_path)
    (path / ".metadata").write_bytes(b"\x80\x04garbage")   # a damaged shard index is found without the shards
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_header(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_header(tmp_path / "nope")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in .*run directory of a unison train run"):
        read_header(tmp_path / "empty_run")


def test_both_kinds_carry_one_header_with_extra(tmp_path):
    dcp_ckpt = load_checkpoint(_sharded_checkpoint(tmp_path / "sharded"))
    pt_ckpt = load_checkpoint(save_checkpoint(tmp_path / "plain", {"method": "byol", "config": {"n": 1}}, 3))
    keys = ["format", "version", "method", "step", "config", "extra"]
    assert list(dcp_ckpt)[:6] == keys and list(pt_ckpt)[:6] == keys
    assert dcp_ckpt["format"] == pt_ckpt["format"] == FORMAT
    assert dcp_ckpt["extra"] == {"scaler": {"per_rank": False, "world_size": 1, "state": {"scale": 2.0}}}
    assert pt_ckpt["extra"] == {} and dcp_ckpt["sharded"] is True and dcp_ckpt["history"] == {"knn_top1": 0.5}


# -- with real processes --

TINY = ["--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--precision", "float64", "--checkpoint-every", "2", "--log-every", "1", "--world-size", "1", *QUIET]




def test_a_resume_reads_the_full_checkpoint_once_and_the_yaml_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--max-steps", "2", "--out", str(run)]) == 0
    config = tmp_path / "more.yaml"
    config.write_text("max_steps: 4\n")

    real_load, real_yaml = torch.load, unison.cli.train_args.load_yaml
    full, mapped, yaml_reads = [], [], []

    def counting_load(f, *args, **kwargs):
        if isinstance(f, (str, Path)) and Path(f).name.startswith("step_"):
            (mapped if kwargs.get("mmap") else full).append(Path(f).name)
        return real_load(f, *args, **kwargs)

    def counting_yaml(path):
        yaml_reads.append(path)
        return real_yaml(path)

    monkeypatch.setattr(torch, "load", counting_load)
    monkeypatch.setattr(unison.cli.train_args, "load_yaml", counting_yaml)
    assert main(["train", *TINY, "--resume", str(run), "--config", str(config)]) == 0
    assert full == ["step_00000002.pt"]                         # the worker's resume, once
    assert mapped == ["step_00000002.pt", "step_00000002.pt"]   # CLI and pre-flight: header only, weights mapped
    assert yaml_reads == [str(config)]
    assert load_checkpoint(run)["step"] == 4


def test_a_damaged_latest_checkpoint_is_said_once_though_two_workers_read_it(tmp_path, capfd):
    """The fall-back warning comes from whichever read first meets the damage (the options, the pre-flight): the
    workers of unison's launcher, which read it again, say nothing more."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--max-steps", "2", "--checkpoint-every", "1", "--out", str(run)]) == 0
    latest = run / "checkpoints" / "step_00000002.pt"
    latest.write_bytes(latest.read_bytes()[:5000])
    capfd.readouterr()
    two_workers = [*TINY[:TINY.index("--world-size")], *TINY[TINY.index("--world-size") + 2:], "--world-size", "2"]
    with warnings.catch_warnings(record=True) as caught:   # this process's warnings; the workers' reach stderr
        warnings.simplefilter("always")
        assert main(["train", *two_workers, "--max-steps", "3", "--resume", "auto", "--out", str(run)]) == 0
    said = capfd.readouterr().err + "\n".join(str(w.message) for w in caught)
    assert said.count(f"checkpoint {latest} is truncated or corrupt") == 1, said
    assert "falling back to step_00000001.pt" in said and load_checkpoint(run)["step"] == 3
