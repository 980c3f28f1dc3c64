"""How often a checkpoint is read: the header alone where that is enough, the full state once per resume.

The CLI (the resumed run's options) and the pre-flight checks (exists, intact, safe, same method) need only
a checkpoint's header; a ``.dcp`` directory's header is read without building a model or touching a shard.
The worker reads the full state once. Both kinds carry the same header, ``extra`` included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.dcp_checkpoint import small_sharded_checkpoint

import unison.cli.train_args
import unison.training.checkpoint.dcp_read as dcp_io
import unison.training.step
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
