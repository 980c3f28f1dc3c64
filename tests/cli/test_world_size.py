"""The default world size and the run directory a fresh run finds, in process: one worker per GPU (torch's device count
patched), more workers than GPUs under NCCL refused before any worker starts, an earlier run set aside whole."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from unison.cli.train_args import parse_train_args
from unison.config import TrainConfig
from unison.distributed.env import LaunchEnv
from unison.errors import ConfigError
from unison.training.run import run_training


@pytest.fixture
def gpus(monkeypatch):
    """Simulate a machine with n visible CUDA devices (0: none) for what the configuration and the launch read."""
    from unison.config import distributed

    def visible(n: int) -> None:
        monkeypatch.setattr(distributed, "GPU_DEVICE_NODES", ("/dev/null",))   # a node exists: torch is asked
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


@pytest.mark.parametrize("count, workers, backend", [(1, 1, "local"), (4, 4, "nccl"), (0, 2, "gloo")])
def test_the_default_world_size_is_one_worker_per_gpu(gpus, tmp_path, count, workers, backend):
    """`unison train --data DIR` on a workstation with one GPU: 2 workers over NCCL on cuda:0, which NCCL refuses.
    The default is one worker per visible GPU (Lightning's devices="auto"); 2 CPU workers without a GPU."""
    gpus(count)
    cfg = parse_train_args(["--data", str(tmp_path), "--out", str(tmp_path / "run")])
    assert (cfg.distributed.world_size, cfg.distributed.resolved_backend()) == (workers, backend)
    assert TrainConfig().distributed.world_size == workers   # the API's default is the same


def test_more_workers_than_gpus_under_nccl_is_refused_before_any_worker_starts(gpus, tmp_path, monkeypatch):
    gpus(1)

    def refuse_to_start(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("unison.training.run.launch", refuse_to_start)
    cfg = parse_train_args(["--world-size", "2", "--max-steps", "1", "--out", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=r"^--world-size 2 with NCCL needs one GPU per worker and this machine shows 1 "
                                          r"\(CUDA_VISIBLE_DEVICES\); give --world-size 1 or less \(the default is one "
                                          r"worker per GPU\), or --backend gloo for 2 workers on the CPU$"):
        run_training(cfg)
    assert not (tmp_path / "run").exists()
    from unison.distributed.env import check_gpu_per_worker

    # started by a launcher (2 processes on this node): the rank without a GPU of its own says so, in one line
    launched = LaunchEnv(rank=1, world_size=2, local_rank=1, master_addr=None, master_port=None, source="slurm")
    with pytest.raises(ConfigError, match=r"^rank 1 is local rank 1 of a node that shows 1 GPU\(s\), and NCCL needs "
                                          r"one GPU per worker: start at most 1 processes per node"):
        check_gpu_per_worker(cfg.distributed, launched)
    check_gpu_per_worker(replace(cfg.distributed, backend="gloo"), None)   # CPU workers: as many as asked


def test_setting_an_earlier_run_aside_moves_everything_and_never_an_input(tmp_path):
    from unison.paths import Input
    from unison.training.owner import EARLIER_RUNS, LOCK_NAME, set_aside_earlier_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003.pt").write_bytes(b"x")
    for name in ("config.json", "metrics.csv", "notes.txt", LOCK_NAME):
        (run / name).write_text(name)
    (run / "val" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"^--val {run / 'val'} lies inside {run / 'val'}, a file of the earlier run"):
        set_aside_earlier_run(run, [Input("--val", run / "val")])
    assert (run / "config.json").exists() and not (run / EARLIER_RUNS).exists()   # refused before anything moved
    folder, moved = set_aside_earlier_run(run, [Input("--data", tmp_path / "data")])
    assert moved == ["checkpoints", "config.json", "metrics.csv", "notes.txt", "val"]
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, EARLIER_RUNS]   # the lock stays: the run holds it
    assert (folder / "notes.txt").read_text() == "notes.txt" and folder.parent == run / EARLIER_RUNS
    (run / "config.json").write_text("the next run")
    second, _ = set_aside_earlier_run(run)
    assert second != folder and (folder / "config.json").read_text() == "config.json"   # never into the same folder
    assert set_aside_earlier_run(run) is None   # nothing left to move
