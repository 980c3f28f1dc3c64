"""How often a checkpoint is read: the header alone where that is enough, the full state once per resume.

The CLI (the resumed run's options) and the pre-flight checks (exists, intact, safe, same method) need only
a checkpoint's header; a ``.dcp`` directory's header is read without building a model or touching a shard.
The worker reads the full state once. Both kinds carry the same header, ``extra`` included.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from fault_helpers import QUIET

import unison.cli.train_args
import unison.training.step
from unison.cli import main
from unison.training.checkpoint import (
    load_checkpoint,
)

TINY = ["--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--precision", "float64", "--checkpoint-every", "2", "--log-every", "1", "--world-size", "1", *QUIET]


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


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
