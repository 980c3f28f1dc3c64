"""What the commands say, in process: the README's map of the commands, the version, numbers as YAML and --param read
them, messages worded for the case (one count, an unknown method, a directory without checkpoints, a missing logger
package) and the progress bar at any terminal width."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from unison.cli import main, make_parser
from unison.cli.train_args import parse_train_args
from unison.config import TrainConfig
from unison.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


README = (ROOT / "README.md").read_text()


CODE_TOUR = (ROOT / "docs" / "guides" / "code-tour.md").read_text()   # the layout of the code, for contributors


def test_scientific_notation_is_a_float_in_yaml_and_param(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1e-3\nweight_decay: 5e-4\nwarmup_epochs: 1e0\nmethod: byol\n")
    cfg = parse_train_args(["--config", str(config), "--param", "momentum_base=1e-2"])
    assert (cfg.lr, cfg.weight_decay, cfg.warmup_epochs) == (1e-3, 5e-4, 1.0)
    assert cfg.method_params == {"momentum_base": 0.01}
    assert isinstance(cfg.method_params["momentum_base"], float)


def test_version_names_unison_torch_and_python(capsys):
    from unison import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"unison {__version__} (torch ")


def _commands() -> list[str]:
    sub = next(a for a in make_parser("")._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)


def test_readme_shows_every_command_and_its_layout_lists_them():
    commands = _commands()
    assert {"train", "plan", "plot", "check", "eval"} <= set(commands)
    for name in commands:
        assert re.search(rf"^unison {name}\b", README, re.M), f"the README shows no `unison {name}` line"
    layout = CODE_TOUR
    cli_line = next(ln for ln in layout.splitlines() if re.match(r"\s*\d+\s+cli/\s", ln))
    listed = set(re.findall(r"[a-z]+", cli_line.split("dispatches", 1)[1]))
    assert set(commands) <= listed, f"the layout's cli/ line lacks {set(commands) - listed}"
    for module in ("plan/", "plotting.py"):
        assert module in layout, f"the layout does not list {module}"


def test_a_method_error_does_not_print_an_empty_hyper_parameter_dict():
    from unison.training.model import build_method

    def message(params: dict) -> str:
        cfg = TrainConfig(method="mae", backbone="small_cnn", method_params=params)
        with pytest.raises(ConfigError) as info:
            build_method(cfg, 1, torch.float32, torch.device("cpu"), 16, backbone="small_cnn")
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


@pytest.mark.parametrize("extra", ["tensorboard", "wandb", "mlflow"])
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


@pytest.mark.parametrize("columns", [50, 80, 100, 140])
def test_progress_bar_keeps_a_bar_and_whole_metrics_at_any_width(columns):
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    from unison.training.progress_bar import MIN_BAR, progress_bar

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with os.fdopen(slave, "w", encoding="utf-8") as terminal:
        bar = progress_bar(150, 0, "simclr x2", file=terminal)
        bar.update(45)
        metrics = {"loss": "4.1234", "img/s": "1234", "probe": "0.54", "RankMe": "12.3", "std": "0.45",
                   "data wait": "3%"}
        bar.show(metrics)
        bar.close()
    shown = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            shown += os.read(master, 1 << 16)
        except OSError:   # EIO: the terminal's other side is closed and everything was read
            break
    os.close(master)
    last = [ln for ln in re.split(r"[\r\n]+", shown.decode()) if ln.strip()][-1]
    assert len(last) < columns and last.endswith(("]", "150")), last     # nothing cut off
    assert len(last.split("|")[1]) >= MIN_BAR and last.startswith("simclr x2:  30%|"), last
    fields = [f for f in re.findall(r", ([^,\]]+)", last) if not f.endswith("step/s")]
    expected = ["loss 4.1234", "1234 img/s", "probe 0.54", "RankMe 12.3", "std 0.45", "data wait 3%"]
    assert fields[:len(fields)] == expected[:len(fields)]   # whole, most important first
    assert ("loss 4.1234" in last) == (columns >= 80) and ("data wait 3%" in last) == (columns >= 140), last
