"""The front door's frictions as a new user met them, in process: the README's map of the commands, the wording
of a few messages, `unison plot`, the progress bar at narrow widths, the evaluation-cost note and setup's stamp.

The ones that start processes (Ctrl-C to a background run, the wheel, a smoke run) are in
tests/distributed/cli/test_frontdoor_frictions.py.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from unison.cli import main, make_parser
from unison.config import TrainConfig
from unison.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


# ------------------------------------------------------------------ the README names every command
def _commands() -> list[str]:
    sub = next(a for a in make_parser("")._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)


def test_readme_shows_every_command_and_its_layout_lists_them():
    commands = _commands()
    assert {"train", "plan", "plot", "check", "eval"} <= set(commands)
    for name in commands:
        assert re.search(rf"^unison {name}\b", README, re.M), f"the README shows no `unison {name}` line"
    layout = README[README.index("## Layout"):]
    cli_line = next(ln for ln in layout.splitlines() if re.match(r"\s*\d+\s+cli/\s", ln))
    listed = set(re.findall(r"[a-z]+", cli_line.split("dispatches", 1)[1]))
    assert set(commands) <= listed, f"the layout's cli/ line lacks {set(commands) - listed}"
    for module in ("plan/", "plotting.py"):
        assert module in layout, f"the layout does not list {module}"


# ------------------------------------------------------------------ wording
def test_a_method_error_does_not_print_an_empty_hyper_parameter_dict():
    from unison.training.model import build_method

    def message(params: dict) -> str:
        cfg = TrainConfig(method="mae", backbone="resnet18", method_params=params)
        with pytest.raises(ConfigError) as info:
            build_method(cfg, 1, torch.float32, torch.device("cpu"), 16, backbone="resnet18")
        return str(info.value)

    plain = message({})
    assert plain.startswith("mae: MAE needs a ViT backbone") and "{}" not in plain and "hyper-parameters" not in plain
    assert message({"mask_ratio": 0.5}).startswith("mae with --param mask_ratio=0.5: MAE needs a ViT backbone")


def test_eval_of_a_directory_without_checkpoints_does_not_talk_of_resuming(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 4
    err = capsys.readouterr().err
    assert err.count("unison: error:") == 1 and "resume" not in err, err
    assert f"no checkpoint in {tmp_path / 'checkpoints'}; give the run directory of a unison train run" in err


def test_counts_are_singular_for_one():
    from unison.config.fields import count
    from unison.training.summary import Summary

    assert (count(1, "step"), count(2, "step"), count(0, "worker"), count(1, "class", "classes")) == (
        "1 step", "2 steps", "0 workers", "1 class")
    summary = Summary("simclr", "small_cnn", "digits", 1, 1, 0.1, 64, 16, 1438, 359, 4.2, 0.9, 0.8, 1.0, 0.0,
                      [10.0], "peak_rss", "runs/x")
    line = summary.result_line(3.0)
    assert line.startswith("simclr x1 worker, 1 step, 3 s: ") and "steps" not in line and "workers" not in line
    summary.world_size, summary.steps = 2, 5
    assert summary.result_line(3.0).startswith("simclr x2 workers, 5 steps, 3 s: ")


@pytest.mark.parametrize("extra", ["tensorboard", "wandb"])
def test_a_missing_logger_package_names_a_command_that_installs_it(extra, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a))
    with pytest.raises(ConfigError) as info:
        TrainConfig(logger=extra).validate()
    text = str(info.value)
    assert "unison[" not in text    # unison is on no package index: `pip install 'unison[x]'` finds nothing
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    assert f"{sys.executable} -m pip install {' '.join(shlex.quote(p) for p in wanted)}" in text, text
