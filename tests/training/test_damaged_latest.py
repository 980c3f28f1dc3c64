"""A run directory whose latest checkpoint is damaged: every command that reads a run falls back to the previous
checkpoint with one warning (one per command, though it reads the checkpoint several times), whatever the damage
(here: truncated to 5 kB, where torch's zip reader fails with ``OSError: Invalid argument`` instead of a zip
error). World size 1: everything runs in this process."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from unison.cli import main

TRAIN = ["train"]   # world size 1 runs in this process: no worker processes
TINY = ["--world-size", "1", "--no-progress", "--batch-size", "16", "--subset", "32", "--val-subset", "32",
        "--knn-k", "5", "--no-random-init-knn", "--signal-images", "0", "--logger", "none"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("damaged") / "run"
    assert main([*TRAIN, "--method", "simclr", "--out", str(out), "--max-steps", "2", "--checkpoint-every", "1",
                 *TINY]) == 0
    return out


COMMANDS = {   # name: (argv given the damaged run and a scratch folder, what shows the previous checkpoint was read)
    "resume-auto": lambda run, tmp: [*TRAIN, "--method", "simclr", "--out", str(run), "--resume", "auto",
                                     "--max-steps", "3", *TINY],
    "resume-run": lambda run, tmp: [*TRAIN, "--method", "simclr", "--out", str(tmp / "b"), "--resume", str(run),
                                    "--max-steps", "3", *TINY],
    "eval": lambda run, tmp: ["eval", "--checkpoint", str(run)],
    "export": lambda run, tmp: ["export", "--checkpoint", str(run), "--out", str(tmp / "e.pt")],
    "init": lambda run, tmp: [*TRAIN, "--method", "simclr", "--out", str(tmp / "c"), "--init", str(run),
                              "--max-steps", "1", *TINY],
    "teacher": lambda run, tmp: [*TRAIN, "--method", "distill", "--out", str(tmp / "t"), "--teacher", str(run),
                                 "--max-steps", "1", *TINY],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_small_truncated_latest_checkpoint_falls_back_to_the_previous(two_checkpoints, command, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / ".unison.lock").unlink(missing_ok=True)
    latest = run / "checkpoints" / "step_00000002.pt"
    latest.write_bytes(latest.read_bytes()[:5000])   # 5 kB of a 3 MB file
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:   # the warning, wherever it is shown
        warnings.simplefilter("always")
        assert main(COMMANDS[command](run, tmp_path)) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "unison: error" not in err, err
    said = err + "\n".join(str(w.message) for w in caught)
    assert f"checkpoint {latest} is truncated or corrupt" in said and "falling back to step_00000001.pt" in said, said
    assert said.count("falling back to") == 1, said   # once per command: not per read (options, pre-flight, worker)
    if command == "teacher":   # the run is pinned to the checkpoint it read
        assert json.loads((tmp_path / "t" / "config.json").read_text())["teacher"].endswith("step_00000001.pt")
    if command == "export":
        assert json.loads((tmp_path / "e.json").read_text())["step"] == 1
