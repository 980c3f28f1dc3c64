"""A stop signal to `unison bench` is one line and exit 75, and leaves no side process running."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import pytest

from unison.bench import commands
from unison.errors import Preempted

pytestmark = pytest.mark.distributed   # bench runs and their side processes


def _cmd(tmp_path, monkeypatch, run_part) -> None:
    monkeypatch.setattr(commands, "_run_part", run_part)
    monkeypatch.setattr(commands, "check_devices", lambda cfg, parts: None)
    ns = argparse.Namespace(part="table", out=str(tmp_path / "bench"))
    monkeypatch.setattr(commands, "overrides_from_namespace", lambda ns, cls: {"out": ns.out})
    commands.cmd_bench(ns)


def test_a_training_run_stopped_by_a_signal_is_the_bench_stopping_not_failing(tmp_path, monkeypatch):
    """It read: "bench race: 'unison train ...' failed: preempted ...; continue with --resume auto", exit 1."""
    def preempted(*args):
        raise Preempted("preempted by SIGUSR1 (received by rank 0) after step 3 of 10: checkpoint x written; "
                        "continue with --resume auto and the same --out", signal_name="SIGUSR1")

    with pytest.raises(Preempted, match=r"^bench table stopped by SIGUSR1: a stopped part reports nothing .* "
                                        r"run the same command again$"):
        _cmd(tmp_path, monkeypatch, preempted)


def test_a_signal_between_training_runs_stops_the_bench_in_one_line(tmp_path, monkeypatch):
    def waits_for_a_signal(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        pytest.fail("the signal did not stop the bench")

    with pytest.raises(Preempted, match="^bench table stopped by SIGTERM"):
        _cmd(tmp_path, monkeypatch, waits_for_a_signal)


def _sleep_long(payload, result) -> None:   # a side process that would run for minutes
    time.sleep(120)


def test_a_stopped_bench_ends_its_side_process(tmp_path):
    """The Lightly side is a spawned process: the bench waited for it (multiprocessing joins children at exit)."""
    import multiprocessing as mp

    from benchmarks.lab.lightly_compare import run_side_process
    from unison.distributed.signals import stop_signals_raise

    before = set(p.pid for p in mp.active_children())
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    with pytest.raises(Preempted):
        with stop_signals_raise(lambda name: Preempted(name)):
            run_side_process(_sleep_long, {}, tmp_path / "side.json", "side", "a side")
    timer.join()
    assert time.monotonic() - started < 30
    assert [p for p in mp.active_children() if p.pid not in before] == []
