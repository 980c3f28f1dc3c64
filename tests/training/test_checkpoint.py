"""Checkpoints: round trip, pruning, crash safety (simulated and real SIGKILL), safe loading, messages."""

from __future__ import annotations

import errno
import os
import pickle
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers.checkpoint import _temporaries

from unison.errors import CheckpointError
from unison.training.checkpoint import (
    check_compatible,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    pack_rng_state,
    read_header,
    restore_rng_state,
    save_checkpoint,
)
from unison.training.checkpoint.header import NO_CHECKPOINT_HINT

try:
    import numpy as np
except ImportError:  # numpy is optional for unison
    np = None


def _state(step: int = 0, method: str = "moco", **extra) -> dict:
    return {"method": method, "config": {"lr": 0.1, "arch": "resnet18"}, "marker": step, **extra}


def _names(run_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir)]


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def _assert_same(a, b, where="state"):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _draws() -> list:
    out = [random.random(), random.gauss(0, 1), torch.rand(5), torch.randn(3)]
    if np is not None:
        out += [np.random.rand(4).tolist(), np.random.normal(size=2).tolist()]
    return out


# ------------------------------------------------------------------ round trip
def test_round_trip_with_model_optimizer_nested_data_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    random.gauss(0, 1)  # leaves a cached gauss_next in the python RNG state
    state = {
        "method": "byol", "config": {"lr": 1e-3, "sizes": [1, 2], "nested": {"flag": True, "none": None}},
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "queue": torch.randn(16, 8), "schedule": {"epoch": 3, "momentum": 0.996, "history": (1, 2.5, "x", None)},
        "rng": pack_rng_state(),
    }
    expected = _draws()

    path = save_checkpoint(tmp_path, state, step=42)
    assert path == tmp_path / "checkpoints" / "step_00000042.pt"
    assert latest_checkpoint(tmp_path) == path and list_checkpoints(tmp_path) == [path]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name

    for source in (path, tmp_path, tmp_path / "checkpoints"):
        ckpt = load_checkpoint(source, expect_method="byol")
        assert (ckpt["format"], ckpt["version"], ckpt["step"], ckpt["method"]) == ("unison-checkpoint", 1, 42, "byol")
        for key in ("config", "model", "optimizer", "queue", "schedule", "rng"):
            _assert_same(state[key], ckpt[key], key)
    if np is not None:  # stored as a tensor so that weights_only loading works
        assert isinstance(ckpt["rng"]["numpy"]["state"], torch.Tensor)

    _draws()  # move every generator on
    restore_rng_state(ckpt["rng"])
    _assert_same(expected, _draws(), "draws after restore")

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    check_compatible(model2, ckpt["model"])
    model2.load_state_dict(ckpt["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt["optimizer"])


def test_save_validates_the_state(tmp_path):
    assert "state['method']" in _error(save_checkpoint, tmp_path, {"config": {}}, 1)
    assert "cfg.to_dict()" in _error(save_checkpoint, tmp_path, {"method": "moco", "config": "lr=0.1"}, 1)
    assert "keep must be" in _error(save_checkpoint, tmp_path, _state(), 1, keep=0)
    assert "step must be" in _error(save_checkpoint, tmp_path, _state(), -1)
    msg = _error(save_checkpoint, tmp_path, _state(extra={"fn": print}), 1)
    assert "state['extra']['fn'] is a builtins.builtin_function_or_method" in msg
    if np is not None:
        assert "numpy.ndarray" in _error(save_checkpoint, tmp_path, _state(x=[np.zeros(2)]), 1)
        assert "numpy.float64" in _error(save_checkpoint, tmp_path, _state(loss=np.float64(1.0)), 1)
    assert list_checkpoints(tmp_path) == []


# ------------------------------------------------------------------ pruning
def test_keeps_only_the_newest_k(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, _state(step), step, keep=2)
    assert _names(tmp_path) == ["step_00000004.pt", "step_00000005.pt"]
    save_checkpoint(tmp_path, _state(6), 6, keep=1)
    assert _names(tmp_path) == ["step_00000006.pt"]
    save_checkpoint(tmp_path, _state(6), 6, keep=1)  # re-saving the same step keeps it
    assert _names(tmp_path) == ["step_00000006.pt"]


def test_resuming_from_an_older_step_keeps_the_new_checkpoints(tmp_path):
    for step in (100, 200, 300):
        save_checkpoint(tmp_path, _state(step), step, keep=3)
    for step in (150, 160, 170):  # resumed from step 100, the new timeline is kept
        save_checkpoint(tmp_path, _state(step), step, keep=3)
        assert load_checkpoint(tmp_path)["step"] == step
    assert _names(tmp_path) == ["step_00000150.pt", "step_00000160.pt", "step_00000170.pt"]


# ------------------------------------------------------------------ simulated crashes
def _assert_previous_intact(run_dir: Path, step: int) -> None:
    assert latest_checkpoint(run_dir).name == f"step_{step:08d}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older file was needed
        ckpt = load_checkpoint(run_dir)
    assert ckpt["step"] == step and ckpt["marker"] == step


def test_crash_inside_torch_save_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), 1)
    real_save = torch.save

    def half_then_crash(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial zip data")
        raise RuntimeError("simulated crash in the middle of torch.save")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, _state(2), 2)
    monkeypatch.setattr(torch, "save", real_save)
    _assert_previous_intact(tmp_path, 1)
    assert _names(tmp_path) == ["step_00000001.pt"] and _temporaries(tmp_path) == []


def test_crash_before_or_after_the_rename_keeps_a_complete_latest(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), 1)
    real_replace = os.replace

    def crash_on(target_name):
        def replace(src, dst):
            if Path(dst).name == target_name:
                raise KeyboardInterrupt(f"simulated kill before renaming onto {target_name}")
            return real_replace(src, dst)
        return replace

    monkeypatch.setattr(os, "replace", crash_on("step_00000002.pt"))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(2), 2)
    _assert_previous_intact(tmp_path, 1)
    assert _names(tmp_path) == ["step_00000001.pt"]

    # Killed after the checkpoint was renamed but before `latest` moved: still consistent.
    monkeypatch.setattr(os, "replace", crash_on("latest"))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(3), 3)
    monkeypatch.setattr(os, "replace", real_replace)
    _assert_previous_intact(tmp_path, 1)
    assert load_checkpoint(tmp_path / "checkpoints" / "step_00000003.pt")["step"] == 3  # complete too
    save_checkpoint(tmp_path, _state(4), 4)
    _assert_previous_intact(tmp_path, 4)


def test_leftover_temporary_file_is_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, _state(1), 1)
    # What a save killed mid-write leaves behind.
    leftover = tmp_path / "checkpoints" / ".step_00000002.pt.12345.deadbeef.tmp"
    leftover.write_bytes(b"PK\x03\x04 half a checkpoint")
    assert _names(tmp_path) == ["step_00000001.pt"]
    _assert_previous_intact(tmp_path, 1)
    save_checkpoint(tmp_path, _state(2), 2)
    assert not leftover.exists() and _temporaries(tmp_path) == []


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_gives_a_clear_error_and_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), 1)

    def write_then_enospc(obj, f, *args, **kwargs):
        f.write(b"x" * 1000)
        _enospc()

    monkeypatch.setattr(torch, "save", write_then_enospc)
    msg = _error(save_checkpoint, tmp_path, _state(2), 2)
    assert msg.startswith("no space left on device: could not write checkpoint ") and "step_00000002.pt" in msg
    assert msg.endswith(f"the last good checkpoint is {tmp_path / 'checkpoints' / 'step_00000001.pt'} (intact); "
                        "free space, then continue with --resume auto")
    monkeypatch.undo()
    _assert_previous_intact(tmp_path, 1)
    assert _names(tmp_path) == ["step_00000001.pt"] and _temporaries(tmp_path) == []

    other = tmp_path / "fresh"
    monkeypatch.setattr(torch, "save", write_then_enospc)
    assert "there is no earlier checkpoint" in _error(save_checkpoint, other, _state(1), 1)
    assert list_checkpoints(other) == [] and _temporaries(other) == []


def test_disk_full_while_updating_latest_rolls_back(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), 1)
    real_fsync, calls = os.fsync, []

    def fsync(fd):  # calls: checkpoint file, directory, then the `latest` file
        calls.append(fd)
        if len(calls) == 3:
            _enospc()
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    msg = _error(save_checkpoint, tmp_path, _state(2), 2)
    monkeypatch.undo()
    assert msg.startswith("no space left on device") and "step_00000001.pt (intact)" in msg
    _assert_previous_intact(tmp_path, 1)
    assert _names(tmp_path) == ["step_00000001.pt"] and _temporaries(tmp_path) == []


# ------------------------------------------------------------------ refusing bad files
class _Payload:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_is_refused_not_executed(tmp_path, writer):
    marker = tmp_path / "pwned"
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    evil = ckpt_dir / "step_00000001.pt"
    obj = {"format": "unison-checkpoint", "version": 1, "method": "moco", "step": 1, "config": {},
           "model": _Payload(marker)}
    if writer == "torch.save":
        torch.save(obj, evil)
    else:
        with open(evil, "wb") as f:
            pickle.dump(obj, f)

    for source in (evil, tmp_path / "run"):
        msg = _error(load_checkpoint, source)
        assert msg.startswith(f"refusing to load {evil}") and "could run code" in msg
        assert not marker.exists()

    with open(evil, "rb") as f:  # the payload is real: an unsafe load does run it
        if writer == "torch.save":
            torch.load(f, weights_only=False)
        else:
            pickle.load(f)
    assert marker.is_dir()


def test_truncated_or_empty_file_is_named_and_a_run_dir_falls_back(tmp_path):
    save_checkpoint(tmp_path, _state(1, payload=torch.randn(1000)), 1)
    second = save_checkpoint(tmp_path, _state(2, payload=torch.randn(1000)), 2)
    data = second.read_bytes()
    for damaged in (data[: len(data) // 2], b""):
        second.write_bytes(damaged)
        msg = _error(load_checkpoint, second)
        assert str(second) in msg and ("truncated or corrupt" in msg or "is empty" in msg)
        with pytest.warns(RuntimeWarning, match="falling back to step_00000001.pt"):
            assert load_checkpoint(tmp_path)["step"] == 1

    for p in list_checkpoints(tmp_path):  # nothing usable at all: the newest file's error
        p.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning):
        msg = _error(load_checkpoint, tmp_path)
    assert str(second) in msg and "truncated or corrupt" in msg


def test_foreign_file_newer_version_and_wrong_method(tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save({"weight": torch.randn(3, 3), "bias": torch.zeros(3)}, plain)
    msg = _error(load_checkpoint, plain)
    assert msg.startswith(f"{plain} is not a unison checkpoint") and "keys weight, bias" in msg
    torch.save([torch.ones(1)], plain)
    assert "not a unison checkpoint (it holds a list" in _error(load_checkpoint, plain)

    future = tmp_path / "future.pt"
    torch.save({"format": "unison-checkpoint", "version": 2, "method": "moco", "step": 1, "config": {}}, future)
    assert "format version 2, this unison reads up to 1; upgrade unison" in _error(load_checkpoint, future)

    path = save_checkpoint(tmp_path / "run", _state(7, method="moco"), 7)
    msg = _error(load_checkpoint, tmp_path / "run", expect_method="simclr")
    assert f"checkpoint {path} was written by method 'moco', this run is 'simclr'" in msg
    assert load_checkpoint(path, expect_method="moco")["step"] == 7


def test_missing_path_and_empty_run_dir(tmp_path):
    assert "does not exist" in _error(load_checkpoint, tmp_path / "nope")
    assert "does not exist" in _error(load_checkpoint, tmp_path / "nope" / "step_00000001.pt")
    assert _error(load_checkpoint, tmp_path) == f"no checkpoint in {tmp_path / 'checkpoints'}; " + NO_CHECKPOINT_HINT
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".step_00000001.pt.1.ab.tmp").write_bytes(b"partial")
    assert _error(load_checkpoint, tmp_path) == f"no checkpoint in {tmp_path / 'checkpoints'}; " + NO_CHECKPOINT_HINT
    assert latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path / "nope") == []


# ------------------------------------------------------------------ model compatibility
class _Net(torch.nn.Module):
    def __init__(self, width: int = 64, head: bool = True):
        super().__init__()
        self.backbone = torch.nn.Sequential()
        self.backbone.add_module("conv1", torch.nn.Conv2d(3, width, 3))
        self.backbone.add_module("bn1", torch.nn.BatchNorm2d(width))
        if head:
            self.head = torch.nn.Linear(width, 10)


def test_check_compatible_names_keys_and_shapes():
    check_compatible(_Net(), _Net().state_dict())

    msg = _error(check_compatible, _Net(64), _Net(32).state_dict())
    assert ("parameter backbone.conv1.weight has shape (32, 3, 3, 3) in the checkpoint "
            "but (64, 3, 3, 3) in the model") in msg
    assert "more shape mismatches" in msg  # bias, bn, head... listed only up to a few

    msg = _error(check_compatible, _Net(head=True), _Net(head=False).state_dict())
    assert "2 missing keys (head.weight, head.bias)" in msg
    state = _Net().state_dict()
    state["extra.weight"] = torch.zeros(1)
    assert "1 unexpected key (extra.weight)" in _error(check_compatible, _Net(), state)

    wrapped = {f"module.{k}": v for k, v in _Net().state_dict().items()}
    assert "model.module.state_dict()" in _error(check_compatible, _Net(), wrapped)


def test_restore_rng_state_rejects_garbage():
    assert "pack_rng_state" in _error(restore_rng_state, {"python": {"version": 3}})
    assert "pack_rng_state" in _error(restore_rng_state, [1, 2])


def test_the_latest_pointer_file_means_its_runs_latest_checkpoint(tmp_path):
    """`--resume RUN/checkpoints/latest` (the pointer file, a name a user tab-completes to) is the run's latest
    checkpoint; it used to be read as a checkpoint and called 'truncated or corrupt (IndexError ...)'."""
    for step in (1, 2):
        save_checkpoint(tmp_path, _state(step), step)
    pointer = tmp_path / "checkpoints" / "latest"
    assert load_checkpoint(pointer)["step"] == 2
    with pytest.raises(CheckpointError, match="step_00000002.pt has an invalid config"):   # a test state, read
        read_header(pointer)                                                               # as a run reads it


# -- with real processes --

try:
    import numpy as np
except ImportError:  # numpy is optional for unison
    np = None


# ------------------------------------------------------------------ real SIGKILL
# Imports torch once, then per line "STEP" on stdin forks a writer that saves STEP+1, STEP+2, ...
# (16 MB each, so most of the time is spent writing and fsyncing) until the test SIGKILLs it.
_WRITER = """
import os, sys, torch
from unison.training.checkpoint import save_checkpoint
run_dir, payload = sys.argv[1], torch.empty(4_000_000)
while line := sys.stdin.readline():
    step = int(line)
    pid = os.fork()
    if pid == 0:
        try:
            while True:
                step += 1
                payload.fill_(step)
                state = {"method": "simclr", "config": {"n": 1}, "payload": payload, "check": step}
                save_checkpoint(run_dir, state, step, keep=2)
                print(f"ready {os.getpid()}", flush=True)
        finally:
            os._exit(1)
    print(f"exit {os.waitpid(pid, 0)[1]}", flush=True)
"""


def _check_after_kill(run_dir: Path, last_step: int) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the latest file itself loads: no fallback needed
        ckpt = load_checkpoint(run_dir, expect_method="simclr")
    assert latest_checkpoint(run_dir).name == f"step_{ckpt['step']:08d}.pt"
    assert ckpt["check"] == ckpt["step"] > last_step
    assert torch.all(ckpt["payload"] == ckpt["step"])
    for path in list_checkpoints(run_dir):  # every file with a final name is complete
        assert load_checkpoint(path)["step"] == int(path.stem.split("_")[1])
    return ckpt["step"]


@pytest.mark.slow
def test_sigkill_during_saves_always_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(1234)
    last_step, mid_write, kills, child = 0, 0, 8, None
    driver = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(kills):  # each round resumes from the latest step the previous kill left
            driver.stdin.write(f"{last_step}\n")
            driver.stdin.flush()
            ready = driver.stdout.readline().split()  # the writer completed one save and goes on
            assert ready and ready[0] == "ready", driver.stderr.read() if driver.poll() is not None else ready
            child = int(ready[1])
            time.sleep(rng.uniform(0.02, 0.3))
            os.kill(child, signal.SIGKILL)
            while (line := driver.stdout.readline()).startswith("ready"):
                pass
            child = None  # reaped by the driver
            status = int(line.split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, line

            mid_write += bool(_temporaries(tmp_path))
            last_step = _check_after_kill(tmp_path, last_step)
    finally:
        if child is not None:  # never leave a writer running after a failure
            os.kill(child, signal.SIGKILL)
        driver.stdin.close()
        driver.kill()
        driver.wait(timeout=30)
        driver.stdout.close()
        driver.stderr.close()
    print(f"{mid_write} of {kills} kills left a half-written temporary file")
