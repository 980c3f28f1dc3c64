"""The front door's frictions as a new user met them, in process: the README's map of the commands, the wording
of a few messages, `unison plot` and its odd inputs, the progress bar at narrow widths.

The ones that start processes (SIGINT to a background run, a smoke run in a 100-column terminal, scripts/setup.sh,
the wheel) are in tests/distributed/cli/test_frontdoor_frictions.py.
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
CODE_TOUR = (ROOT / "docs" / "guides" / "code-tour.md").read_text()   # the layout of the code, for contributors


# ------------------------------------------------------------------ the README names every command
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


# ------------------------------------------------------------------ wording
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


# ------------------------------------------------------------------ unison plot
def _run_dir(root: Path, name: str, rows: list[str], header: str = "step,epoch,loss,lr") -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")
    return run


def _short_run(root: Path, name: str = "short") -> Path:
    """Five steps of a 700-step epoch, as `--max-steps 5` on CIFAR-10 logs them."""
    return _run_dir(root, name, [f"{s},{s / 700:.6f},{4 - 0.1 * s},0.1" for s in range(6)])


def _plot(argv: list[str], capsys, code: int = 0) -> str:
    assert main(["plot", *argv]) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("unison: error:") == (code != 0), captured.err
    return captured.err


def _figures(monkeypatch) -> list:
    """The axes (x label, x range) of each figure `unison plot` saves."""
    from matplotlib.figure import Figure

    seen: list = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (seen.append(
        [(ax.get_xlabel(), ax.get_xlim()) for ax in fig.axes]), save(fig, *a, **k)))
    return seen


def test_plot_of_short_runs_is_by_steps_and_of_long_runs_by_epochs(tmp_path, capsys, monkeypatch):
    seen = _figures(monkeypatch)
    short, other = _short_run(tmp_path), _short_run(tmp_path, "other")
    _plot([str(short), str(other), "--out", str(tmp_path / "a.png")], capsys)
    assert {label for label, _ in seen[-1]} == {"step"} and seen[-1][0][1][1] == pytest.approx(5 * 1.05)
    long = _run_dir(tmp_path, "long", [f"{s * 50},{s / 2},{4 - 0.1 * s},0.1" for s in range(9)])   # 4 epochs
    _plot([str(long), str(short), "--out", str(tmp_path / "b.png")], capsys)
    assert {label for label, _ in seen[-1]} == {"epoch"}
    _plot([str(long), "--x", "step", "--out", str(tmp_path / "c.png")], capsys)
    assert {label for label, _ in seen[-1]} == {"step"} and seen[-1][0][1][1] == pytest.approx(400 * 1.05)


def test_plot_out_is_never_silently_overwritten(tmp_path, capsys):
    """An existing page, its own earlier one too, is replaced only with --overwrite; --replace, the flag's earlier
    name, still works and says so in one line."""
    run, out = _short_run(tmp_path), tmp_path / "page.png"
    _plot([str(run), "--out", str(out)], capsys)
    first = out.read_bytes()
    err = _plot([str(run), "--out", str(out)], capsys, code=2)
    assert "already exists (a plot written by unison plot)" in err and "pass --overwrite" in err
    assert out.read_bytes() == first
    _plot([str(run), "--out", str(out), "--overwrite"], capsys)
    other = tmp_path / "photo.png"
    other.write_bytes(b"\x89PNG someone else's")
    assert "already exists; it is left as it is" in _plot([str(run), "--out", str(other)], capsys, code=2)
    assert other.read_bytes() == b"\x89PNG someone else's"
    with pytest.warns(FutureWarning, match=r"^--replace is deprecated: use --overwrite"):
        _plot([str(run), "--out", str(other), "--replace"], capsys)
    assert other.read_bytes().startswith(b"\x89PNG") and other.read_bytes() != b"\x89PNG someone else's"


def test_plot_reads_odd_but_valid_files_and_names_a_bad_one(tmp_path, capsys):
    huge = _run_dir(tmp_path, "huge", ["0,0,1e308,0.1", "1,0.001,-1e308,0.1", "2,0.002,3.5,0.1"])
    _plot([str(huge), "--out", str(tmp_path / "huge.png")], capsys)
    odd = _short_run(tmp_path, r"run_$\frac{$_and_$x^2$")   # matplotlib mathtext, twice (one of them invalid)
    hidden = _short_run(tmp_path, "_underscored")
    _plot([str(odd), str(hidden), "--out", str(tmp_path / "odd.png")], capsys)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfstep,epoch,loss\n0,0,4.0\n1,0.1,3.9\n")   # "CSV UTF-8" of a spreadsheet
    _plot([str(bom), "--out", str(tmp_path / "bom.png")], capsys)
    long_field = tmp_path / "long.csv"
    long_field.write_text("step,epoch,loss\n0,0,1\n1,0.1," + "9" * 140_000 + "\n")
    err = _plot([str(long_field), "--out", str(tmp_path / "x.png")], capsys, code=3)
    assert f"metrics file {long_field} line 3 is not CSV" in err
    assert not (tmp_path / "x.png").exists()


def test_plot_labels_are_drawn_as_written():
    from unison.training.plots import runs_figure

    rows = [{"step": 0, "epoch": 0.0, "loss": 1.0}, {"step": 1, "epoch": 0.1, "loss": 0.9}]
    fig = runs_figure([(r"a_$\frac{$", rows, None), ("_b", rows, None)])
    shown = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    fig.canvas.draw()   # mathtext would raise here
    assert len(shown) == 2 and shown[1].endswith("_b")


def test_plot_on_a_full_disk_leaves_no_file_behind(tmp_path, capsys, monkeypatch):
    import errno

    from matplotlib.figure import Figure

    def full_disk(self, fname, **kwargs):
        Path(fname).write_bytes(b"")   # what a write that ran out of space leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    run, out = _short_run(tmp_path), tmp_path / "out" / "page.png"
    out.parent.mkdir()
    with monkeypatch.context() as m:
        m.setattr(Figure, "savefig", full_disk)
        err = _plot([str(run), "--out", str(out)], capsys, code=2)
    assert f"no space left on device: could not write {out}" in err
    assert list(out.parent.iterdir()) == []   # neither a 0-byte page nor a temporary
    _plot([str(run), "--out", str(out)], capsys)   # space again: the same command works
    assert out.read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------ the progress bar at any width
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
