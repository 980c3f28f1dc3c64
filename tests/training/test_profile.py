"""``--profile-steps N``: a real run records N steps after the skip with torch.profiler, and says what a step cost."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from unison.cli import main
from unison.training.profile import SKIP_STEPS, kernel_seconds, summary_line

RUN = ["train", "--method", "simclr", "--batch-size", "16", "--subset", "64", "--no-knn", "--signal-images", "0",
       "--no-online-probe", "--no-progress", "--world-size", "1"]


def _trace_steps(folder: Path) -> list[dict]:
    """The optimiser steps' record_function spans in the rank-0 trace."""
    with gzip.open(folder / "rank0-trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if str(e.get("name", "")).startswith("Optimizer.step")]


def test_a_run_records_the_asked_steps_after_the_skip(tmp_path, capfd):
    out = tmp_path / "run"
    assert main([*RUN, "--max-steps", str(SKIP_STEPS + 5), "--profile-steps", "3", "--out", str(out)]) == 0
    folder = out / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0-ops.txt", "rank0-trace.json.gz"]
    assert len(_trace_steps(folder)) == 3   # three optimiser steps, not the skipped ones or the two after
    ops = (folder / "rank0-ops.txt").read_text()
    assert "Self CPU" in ops and "aten::" in ops
    line = next(x for x in (out / "train.log").read_text().splitlines() if "profile:" in x)
    assert "profile: 3 steps, " in line and " ms per step" in line and "device busy" not in line   # no GPU here
    err = capfd.readouterr().err
    assert "profile: 3 steps" in err
    assert "USDT:" not in err and "gpuGetDeviceCount" not in err   # kineto's own log lines stay off


def test_a_run_shorter_than_the_skip_records_what_it_has_and_says_so(tmp_path):
    out = tmp_path / "run"
    assert main([*RUN, "--max-steps", "4", "--profile-steps", "6", "--out", str(out)]) == 0
    assert len(_trace_steps(out / "profile")) == 4   # from the first step: there is no room to skip
    line = next(x for x in (out / "train.log").read_text().splitlines() if "profile:" in x)
    assert "profile: 4 steps" in line and "asked for 6; the run ended first" in line


def test_no_profile_folder_without_the_flag(tmp_path):
    out = tmp_path / "run"
    assert main([*RUN, "--max-steps", "2", "--out", str(out)]) == 0
    assert not (out / "profile").exists()


def test_a_negative_step_count_is_refused_in_one_line(tmp_path, capsys):
    assert main([*RUN, "--max-steps", "2", "--profile-steps", "-1", "--out", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile" in err[0] and "Traceback" not in err[0]


class _Event:
    def __init__(self, device: str, self_us: float, annotation: bool = False):
        self.device_type = getattr(torch.autograd.DeviceType, device)
        self.self_device_time_total = self_us
        self.is_user_annotation = annotation


def test_kernel_time_counts_device_events_once():
    """A host operator's device time is its kernels', which are events of their own: only those are summed."""
    events = [_Event("CPU", 900.0), _Event("CUDA", 600.0), _Event("CUDA", 300.0), _Event("CUDA", 50.0, True)]
    assert kernel_seconds(events) == pytest.approx(900e-6)


def test_the_summary_line_says_how_busy_the_device_was():
    line = summary_line(20, 20, wall_s=1.0, kernels_s=0.25, folder=Path("runs/x/profile"))
    assert line == ("profile: 20 steps, 50.0 ms per step, device busy 25 % (12.5 ms of kernels per step); "
                    "trace and operator table in runs/x/profile")


def test_the_hook_says_which_steps_it_records(tmp_path):
    """A --time-budget run does not time them (`unison.training.replan`): the ones the trace holds, 1-based."""
    from types import SimpleNamespace

    from unison.training.profile import ProfileHook

    hook = ProfileHook(tmp_path, 3, rank=0)
    hook.start(SimpleNamespace(total_steps=100, device=torch.device("cpu")), 0)
    assert [s for s in range(1, 30) if hook.records(s)] == [SKIP_STEPS + 1, SKIP_STEPS + 2, SKIP_STEPS + 3]
    hook.start(SimpleNamespace(total_steps=100, device=torch.device("cpu")), 40)   # a resumed attempt skips again
    assert [s for s in range(1, 80) if hook.records(s)] == [51, 52, 53]
