"""``--checkpoint-every`` as a duration: rank 0's clock decides and every rank joins the same saves."""

from __future__ import annotations

from unison.cli import main
from unison.training.checkpoint import list_checkpoints, load_checkpoint

TINY = ["--batch-size", "64", "--max-steps", "4", "--subset", "256", "--val-subset", "64", "--knn-k", "5",
        "--no-progress", "--no-random-init-knn", "--signal-images", "0", "--keep-checkpoints", "10"]


def test_a_time_cadence_saves_on_every_rank_at_the_same_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    run = tmp_path / "run"
    # 1 ms: due after every step (a step takes longer); rank 0 decides and broadcasts, every rank follows
    assert main(["train", *TINY, "--world-size", "2", "--checkpoint-every", "0.001s", "--out", str(run)]) == 0
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(run)] == [1, 2, 3, 4]
    assert load_checkpoint(run)["config"]["checkpoint_every"] == "0.001s"
