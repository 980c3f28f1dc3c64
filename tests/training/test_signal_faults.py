"""The signals against hostile runs: non-finite embeddings end the run with their cause (not an SVD traceback, and a
NaN before any update is not blamed on --lr), and ``--stop-on-collapse`` with too few held-back images is refused
or turned off with one line instead of stopping every run at step 2 (or doing nothing). World size 1: everything
runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from fault_helpers import error_line, run_cli

import unison
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import NonFiniteLossError
from unison.models.backbones import build_backbone

TRAIN = ["train"]   # world size 1 runs in this process: no worker processes
TINY = ["--world-size", "1", "--no-progress", "--batch-size", "16", "--subset", "32", "--val-subset", "32",
        "--knn-k", "5", "--no-random-init-knn", "--logger", "none", "--max-steps", "2"]


def _run(argv: list[str], capfd) -> tuple[int, str]:
    return run_cli([*TRAIN, *argv], capfd)


def _line(err: str) -> str:
    return error_line(err)


@pytest.fixture(scope="module")
def huge_weights(tmp_path_factory) -> Path:
    """small_cnn's weights, every float set to 1e38 (finite, but its features overflow float32)."""
    net, _ = build_backbone("small_cnn", 16)
    path = tmp_path_factory.mktemp("init") / "huge.pt"
    torch.save({k: torch.full_like(v, 1e38) if v.is_floating_point() else v for k, v in net.state_dict().items()},
               path)
    return path


@pytest.mark.parametrize("signals", ["32", "0"], ids=["signals-measured-first", "loss-first"])
def test_init_weights_that_overflow_are_named_not_lr(huge_weights, signals, tmp_path, capfd):
    code, err = _run(["--method", "simclr", "--init", str(huge_weights), "--signal-images", signals,
                      "--out", str(tmp_path / "run"), *TINY], capfd)
    line = _line(err)
    assert code == 5, err
    what = "non-finite embeddings of the held-back images" if signals != "0" else "non-finite loss (nan)"
    assert line.startswith(f"unison: error: {what}") and "at step 0" in line, line
    assert f"the weights of --init {huge_weights} reach |w| = 1e+38" in line and "--lr" not in line, line


class SqrtNet(nn.Module):
    """A backbone whose forward takes the square root of its input (its weights are ordinary): finite on the
    pre-flight's pixels in [0, 1], NaN on the normalised views of training (negative values)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.sqrt()).mean((2, 3))


@pytest.mark.parametrize("signal_images", [32, 0])
def test_an_own_backbone_returning_nan_is_named(signal_images, tmp_path):
    config = TrainConfig(method="simclr", data="digits", batch_size=16, subset=32, max_steps=2, progress=False,
                         signal_images=signal_images, random_init_knn=False, logger="none", out=str(tmp_path / "run"),
                         distributed=DistributedConfig(world_size=1))
    with pytest.raises(NonFiniteLossError) as caught:
        unison.train(config, backbone=SqrtNet(), feature_dim=8)
    message = str(caught.value)
    assert "at step 0" in message and "your backbone= (" in message and "SqrtNet) returns NaN or inf" in message
    assert "fix it" in message and "--lr" not in message and "\n" not in message, message


@pytest.mark.parametrize("images, fragment", [
    ("1", "--stop-on-collapse cannot judge collapse on --signal-images 1"),
    ("2", "--stop-on-collapse cannot judge collapse on --signal-images 2"),
    ("0", "--stop-on-collapse watches the signals and --signal-images 0 turns them off"),
], ids=["1-image", "2-images", "no-signals"])
def test_stop_on_collapse_without_enough_signal_images_is_refused(images, fragment, tmp_path, capfd):
    code, err = _run(["--method", "simclr", "--stop-on-collapse", "--signal-images", images,
                      "--out", str(tmp_path / "run"), *TINY], capfd)
    assert code == 2 and fragment in _line(err), err
    assert not (tmp_path / "run").exists()


def test_stop_on_collapse_on_data_too_small_to_judge_says_it_is_off(tmp_path, capfd):
    out = tmp_path / "run"
    code, err = _run(["--method", "simclr", "--stop-on-collapse", "--signals-every", "1", "--out", str(out),
                      "--world-size", "1", "--no-progress", "--batch-size", "4", "--subset", "8", "--val-subset", "8",
                      "--knn-k", "3", "--no-random-init-knn", "--logger", "none", "--max-steps", "4"], capfd)
    assert code == 0, err
    assert ("unison: warning: --stop-on-collapse is off for this run: only 8 held-back image(s) (the data has 8), "
            "and collapse needs 16 or more to be judged") in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and "collapsed" not in err, (summary, err)
