"""Resuming with more --epochs/--max-steps than the checkpoint's run was planned for (issue 22, nit 9): the
schedules follow the new length, and the run says so in one line (train.log and the terminal)."""

from __future__ import annotations

import json

from unison.cli import main

_TINY = ["train", "--world-size", "1", "--batch-size", "8", "--subset", "32", "--val-subset", "16", "--knn-k", "5",
         "--no-progress", "--no-random-init-knn", "--checkpoint-every", "1"]


def test_a_longer_resume_says_the_schedule_follows_the_new_length(tmp_path, capfd):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*_TINY, "--max-steps", "2", "--out", str(first)]) == 0
    capfd.readouterr()
    assert main([*_TINY, "--max-steps", "4", "--resume", str(first), "--out", str(second)]) == 0
    said = capfd.readouterr()
    line = "the checkpoint's run was planned for 2 steps, this one for 4 (--epochs/--max-steps): from step 2"
    assert line in said.out + said.err
    assert line in (second / "train.log").read_text()
    assert json.loads((second / "config.json").read_text())["resolved"]["resumed_from_total_steps"] == 2


def test_the_same_length_says_nothing(tmp_path, capfd):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*_TINY, "--max-steps", "2", "--out", str(first)]) == 0
    assert main([*_TINY, "--max-steps", "2", "--resume", str(first / "checkpoints" / "step_00000001.pt"),
                 "--out", str(second)]) == 0
    said = capfd.readouterr()
    assert "planned for" not in said.out + said.err
