"""`unison plot`, in process: what it draws (by steps or epochs, the baselines by their names, labels as written), odd but valid
metrics files, and the files it writes (never silently overwritten, nothing left on a full disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.cli import main


def test_plot_of_a_short_run_shows_its_points_and_the_baseline():
    from unison.training.metrics import metrics_figure

    rows = [{"step": 2, "epoch": 0.5, "loss": 4.2, "knn_top1": None},
            {"step": 2, "epoch": 0.5, "loss": None, "knn_top1": 0.81}]
    fig = metrics_figure(rows, random_init_knn_top1=0.75)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    ax_loss, ax_knn = by_title["training loss"], by_title["accuracy (kNN held-out, online probe)"]
    (loss_line,) = ax_loss.get_lines()
    assert loss_line.get_marker() == "o"                         # one point is a visible dot, not an empty line
    knn_lines = ax_knn.get_lines()
    baseline = [ln for ln in knn_lines if list(ln.get_ydata()) == [0.75, 0.75]]
    assert len(baseline) == 1 and baseline[0].get_linestyle() == "--"
    low, high = ax_knn.get_ylim()
    assert 0 <= low < 0.75 and 0.81 < high <= 1


def test_the_plot_draws_a_random_and_an_init_baseline_each_by_its_name(tmp_path):
    """plot.png and `unison plot` of a run started from --init: the random encoder's kNN dashed and the --init
    weights' kNN dash-dotted, each labelled by what it is (summary.json holds both)."""
    import json

    from unison.plotting import _baselines
    from unison.training.metrics import metrics_figure

    rows = [{"step": 2, "epoch": 0.5, "loss": None, "knn_top1": 0.81}]
    (tmp_path / "summary.json").write_text(json.dumps({"random_init_knn_top1": 0.7577, "init_knn_top1": 0.7354}))
    baselines = _baselines(tmp_path)
    assert baselines == {"random init": 0.7577, "--init weights": 0.7354}
    fig = metrics_figure(rows, random_init_knn_top1=0.7577, init_knn_top1=0.7354)
    (ax_knn,) = [ax for ax in fig.axes if ax.get_title().startswith("accuracy")]
    labels = dict(zip(*reversed(ax_knn.get_legend_handles_labels())))
    assert labels["random init (0.758)"].get_linestyle() == "--"
    assert labels["--init weights (0.735)"].get_linestyle() == "-."
    (tmp_path / "summary.json").write_text(json.dumps({"random_init_knn_top1": 0.7577, "init_knn_top1": None}))
    assert _baselines(tmp_path) == {"random init": 0.7577}


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
