"""``--checkpoint-every`` in steps or time: one parser for the flag, YAML and the API.

``--checkpoint-every`` as a duration: rank 0's clock decides and every rank joins the same saves."""

from __future__ import annotations

import pytest

from unison.cli import main
from unison.cli.train_args import parse_train_args
from unison.config import TrainConfig
from unison.config.train import checkpoint_cadence
from unison.errors import ConfigError
from unison.training.checkpoint import list_checkpoints, load_checkpoint


@pytest.mark.parametrize("value, steps, seconds", [
    (0, 0, 0.0), (50, 50, 0.0), ("50", 50, 0.0), ("30s", 0, 30.0), ("10m", 0, 600.0), ("2h", 0, 7200.0),
    ("1.5m", 0, 90.0), (" 10M ", 0, 600.0), ("1h30m", 0, 5400.0)])
def test_checkpoint_cadence_reads_steps_or_a_duration(value, steps, seconds):
    cadence = checkpoint_cadence(value)
    assert (cadence.steps, cadence.seconds) == (steps, seconds)


@pytest.mark.parametrize("value", [-1, "-1", "5x", "0s", "m", True, 1.5, "1e400", "200d", "9" * 30, None, "\u0663",
                                   "2\u00b2s", "--5"])
def test_checkpoint_cadence_refuses_anything_else_in_one_line(value):
    with pytest.raises(ConfigError, match=r"checkpoint_every=.* must be an integer >= 0 .* or a duration"):
        checkpoint_cadence(value)


def test_checkpoint_every_from_the_command_line_and_the_api():
    assert parse_train_args(["--checkpoint-every", "10m"]).checkpoint_every == "10m"
    assert parse_train_args(["--checkpoint-every", "50"]).checkpoint_every == 50
    assert TrainConfig(checkpoint_every="30S").validate().checkpoint_every == "30s"
    with pytest.raises(ConfigError, match="checkpoint_every=-1 must be an integer >= 0"):
        TrainConfig(checkpoint_every=-1).validate()


# -- with real processes --

TINY = ["--batch-size", "64", "--max-steps", "4", "--subset", "256", "--val-subset", "64", "--knn-k", "5",
        "--no-progress", "--no-random-init-knn", "--signal-images", "0", "--keep-checkpoints", "10"]


def test_a_time_cadence_saves_on_every_rank_at_the_same_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    run = tmp_path / "run"
    # 1 ms: due after every step (a step takes longer); rank 0 decides and broadcasts, every rank follows
    assert main(["train", *TINY, "--world-size", "2", "--checkpoint-every", "0.001s", "--out", str(run)]) == 0
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(run)] == [1, 2, 3, 4]
    assert load_checkpoint(run)["config"]["checkpoint_every"] == "0.001s"
