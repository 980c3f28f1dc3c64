"""Complete and asynchronous checkpoints: the extra state a checkpoint carries (GradScaler, per-rank state), and the
background writer (snapshot isolation, failures surfaced, abort without a half-written file)."""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings

import pytest
import torch

from unison.equivalence import assert_states_close
from unison.errors import CheckpointError
from unison.training.checkpoint import (
    Checkpointer,
    ExtraState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    snapshot,
)


def _state(step: int, payload: torch.Tensor | None = None, **extra) -> dict:
    return {"method": "simclr", "config": {"n": 1}, "payload": payload if payload is not None else torch.zeros(3),
            **extra}


# ------------------------------------------------------------------ GradScaler (fp16)
def _scaler_after_overflows() -> torch.amp.GradScaler:
    """A CPU GradScaler whose scale and growth tracker moved as in training: two overflows, then good steps."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    for grad in (float("inf"), float("nan"), 1.0, 1.0):
        opt.zero_grad()
        scaler.scale((w * grad).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def test_grad_scaler_state_round_trips_through_a_checkpoint_file(tmp_path):
    scaler = _scaler_after_overflows()
    state = scaler.state_dict()
    assert state["scale"] == 2.0**14 and state["_growth_tracker"] == 2   # it did move
    extra = ExtraState()
    extra.register("grad_scaler", scaler)
    save_checkpoint(tmp_path, _state(1, extra=extra.collect()), 1)

    ckpt = load_checkpoint(tmp_path)    # weights_only: the scaler's state is plain data
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    restored = ExtraState()
    restored.register("grad_scaler", fresh)
    restored.restore(ckpt["extra"])
    assert fresh.state_dict() == state
    assert ckpt["extra"]["grad_scaler"] == {"per_rank": False, "world_size": 1, "state": state}


# ------------------------------------------------------------------ the registry
class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_missing_and_unknown_extra_state_warn_and_per_rank_state_needs_the_same_world_size():
    saved = {"per_rank": True, "world_size": 2, "state": [{"n": 1}, {"n": 2}]}
    extra, counter, fresh = ExtraState(), _Counter(), _Counter()
    extra.register("counter", counter, per_rank=True)
    extra.register("new", fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra.restore({"counter": saved, "gone": {"per_rank": False, "world_size": 1, "state": {}}})
    messages = [str(w.message) for w in caught]
    assert counter.n == 0   # saved at world size 2, this process is world size 1
    assert any("'counter' state is per rank and was saved at world size 2, this run has 1" in m for m in messages)
    assert any("no 'new' state (an older checkpoint); it starts fresh" in m for m in messages)
    assert any("state this run does not use (gone)" in m for m in messages)
    same_world = ExtraState()
    same_world.register("counter", counter, per_rank=True)
    same_world.restore({"counter": {**saved, "world_size": 1, "state": [{"n": 5}]}})
    assert counter.n == 5
    with pytest.raises(TypeError):
        ExtraState().register("x", object())   # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="malformed"):
        same_world.restore({"counter": 3})


# ------------------------------------------------------------------ the asynchronous writer
def test_asynchronous_save_writes_a_snapshot_taken_when_save_returns(tmp_path):
    started, release = threading.Event(), threading.Event()

    def slow(step: int, written: int) -> None:   # the file is written while the "training" goes on
        started.set()
        release.wait(10)

    ckpt = Checkpointer(tmp_path, keep=3, asynchronous=True, on_write=slow)
    live = torch.zeros(1000)
    ckpt.save(_state(1, live), 1)
    assert started.wait(10) and ckpt.in_flight
    live.fill_(7.0)   # the next optimiser step changes the parameters in place
    release.set()
    assert ckpt.wait() == tmp_path / "checkpoints" / "step_00000001.pt"
    assert torch.equal(load_checkpoint(tmp_path)["payload"], torch.zeros(1000))
    assert not ckpt.in_flight


def test_snapshot_copies_tensors_and_keeps_structure():
    t = torch.arange(3.0)
    s = snapshot({"a": [t, (t, 1)], "b": "x"})
    t.add_(1)
    assert torch.equal(s["a"][0], torch.arange(3.0)) and s["a"][1][1] == 1 and s["b"] == "x"


def test_a_failed_background_save_is_raised_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep=3, asynchronous=True)
    ckpt.save(_state(1), 1)
    ckpt.wait()
    real_fsync = os.fsync

    def flaky_fsync(fd):   # a failing disk: the data did not reach it
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", flaky_fsync)
    ckpt.save(_state(2), 2)
    while ckpt.in_flight:
        time.sleep(0.01)
    assert ckpt.failed()
    with pytest.raises(CheckpointError) as info:
        ckpt.raise_if_failed()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert str(info.value) == (f"could not write checkpoint {tmp_path / 'checkpoints' / 'step_00000002.pt'} "
                               f"(Input/output error); the last good checkpoint is "
                               f"{tmp_path / 'checkpoints' / 'step_00000001.pt'} (intact)")
    assert load_checkpoint(tmp_path)["step"] == 1
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_abort_stops_an_unfinished_save_without_a_half_written_file(tmp_path):
    started = threading.Event()

    def slow(step: int, written: int) -> None:
        started.set()
        time.sleep(0.05)

    ckpt = Checkpointer(tmp_path, keep=3, asynchronous=False)
    ckpt.save(_state(1), 1)
    ckpt = Checkpointer(tmp_path, keep=3, asynchronous=True, on_write=slow)
    ckpt.save(_state(2, torch.zeros(2_000_000)), 2)   # 8 MB: many writes, each slowed down
    assert started.wait(10)
    ckpt.close(abort=True)
    assert latest_checkpoint(tmp_path).name == "step_00000001.pt"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000001.pt"]


def test_synchronous_save_raises_at_once(tmp_path, monkeypatch):
    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    ckpt = Checkpointer(tmp_path, keep=3, asynchronous=False)
    monkeypatch.setattr(os, "write", enospc)   # the OS boundary: every write of the checkpoint file fails
    with pytest.raises(CheckpointError, match=r"^no space left on device: could not write checkpoint .*; there is no "
                                              r"earlier checkpoint; free space, then start again$"):
        ckpt.save(_state(1), 1)


# -- with real processes --

@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 GradScaler only acts on CUDA; no GPU on this machine")
def test_fp16_run_with_grad_scaler_resumes_identically(tmp_path):
    from unison.cli import main

    tiny = ["train", "--world-size", "1", "--amp", "fp16", "--batch-size", "64", "--subset", "256", "--val-subset",
            "64", "--knn-k", "5", "--no-progress", "--max-steps", "6", "--checkpoint-every", "3", "--deterministic"]
    assert main([*tiny, "--out", str(tmp_path / "ref")]) == 0
    mid = tmp_path / "ref" / "checkpoints" / "step_00000003.pt"
    assert "grad_scaler" in load_checkpoint(mid)["extra"]
    assert main(["train", "--resume", str(mid), "--out", str(tmp_path / "resumed"), "--no-progress"]) == 0
    a, b = load_checkpoint(tmp_path / "resumed"), load_checkpoint(tmp_path / "ref")
    assert a["extra"]["grad_scaler"] == b["extra"]["grad_scaler"]   # scale and growth tracker continue exactly
    assert_states_close(a["model"], b["model"], 1e-5, "model")     # float32 on a GPU: deterministic kernels, not bits
