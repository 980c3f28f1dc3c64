"""What `unison plot` (and each run's own ``plot.png``) draws from a ``metrics.csv``: one point per step, its later
row where a step was logged twice (a resumed or re-formed run trains the steps after its checkpoint again), and one
line naming the file where its header names a column twice."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from unison.cli import main
from unison.training.metrics import COLUMNS, MetricsLogger, rows_by_step

# An elastic run: 2 workers to step 9, a checkpoint at step 6, the group re-formed with 1 worker, steps 7-12 again
HEADER = ",".join(COLUMNS)
FIRST = [f"{s},{s / 4},{10 - s},0.1,,,,,,,,,2" for s in range(1, 10)]
AGAIN = [f"{s},{s / 4},{10 - s - 0.5},0.1,,,,,,,,,1" for s in range(7, 13)]
KNN = ["12,3.0,,,,0.42,,,,,,,1"]   # the end's kNN: a row of its own at the last step


def _figures(monkeypatch) -> list:
    seen: list = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (seen.append(fig), save(fig, *a, **k)))
    return seen


def _loss_line(fig):
    ax = next(a for a in fig.axes if "loss" in a.get_title().lower() or "loss" in a.get_ylabel().lower())
    return [(float(x), float(y)) for x, y in zip(*ax.get_lines()[0].get_data())]


def test_a_step_logged_twice_is_drawn_from_its_later_row(tmp_path, capsys, monkeypatch):
    path = tmp_path / "metrics.csv"
    path.write_text("\n".join([HEADER, *FIRST, *AGAIN, *KNN]) + "\n")
    seen = _figures(monkeypatch)
    assert main(["plot", str(path), "--x", "step", "--out", str(tmp_path / "page.png")]) == 0
    line = _loss_line(seen[-1])
    assert [x for x, _ in line] == list(range(1, 13))   # was 1..9, then back to 7..12
    assert line[5] == (6, 4.0) and line[6] == (7, 2.5) and line[8] == (9, 0.5)   # steps 7-9: the second attempt's
    rows = rows_by_step([{"step": 12, "loss": 1.0, "knn_top1": None}, {"step": 12, "loss": None, "knn_top1": 0.4}])
    assert rows == [{"step": 12, "loss": 1.0, "knn_top1": 0.4}]   # a step's events are rows of their own


def test_the_runs_own_plot_takes_the_same_rows(tmp_path, monkeypatch):
    """A resumed run appends to its metrics.csv, and its plot.png at the end draws what `unison plot` draws."""
    (tmp_path / "metrics.csv").write_text("\n".join([HEADER, *FIRST]) + "\n")
    seen = _figures(monkeypatch)
    logger = MetricsLogger(tmp_path)   # the resumed attempt
    for row in AGAIN:
        step, epoch, loss = row.split(",")[:3]
        logger.log(step=int(step), epoch=float(epoch), loss=float(loss), lr=0.1, world_size=1)
    logger.close()
    assert [x for x, _ in _loss_line(seen[-1])] == [s / 4 for s in range(1, 13)]


@pytest.mark.parametrize("header", ["step,epoch,loss,step", "step,epoch,loss,loss"])
def test_a_header_naming_a_column_twice_is_one_line(tmp_path, capsys, header):
    path = tmp_path / "metrics.csv"
    path.write_text(f"{header}\n1,0.1,4.0,2\n2,0.2,3.9,3\n")
    assert main(["plot", str(path), "--out", str(tmp_path / "page.png")]) == 3
    err = capsys.readouterr().err
    name = header.rsplit(",", 1)[1]
    first = header.split(",").index(name) + 1
    assert err.strip() == (f"unison: error: metrics file {path} names the column {name!r} twice (columns {first}, 4); "
                           "a unison metrics.csv names each column once"), err
    assert not (tmp_path / "page.png").exists()


@pytest.mark.parametrize("header, missing", [("step,loss,lr,step", "no 'epoch' column"),
                                             ("epoch,loss", "no 'step' column"), ("", "no 'step' and no 'epoch'")])
def test_a_header_without_step_or_epoch_names_the_column_it_lacks(tmp_path, capsys, header, missing):
    """A file holding one of the two columns is told which one it lacks, not that it has neither."""
    path = tmp_path / "metrics.csv"
    path.write_text(f"{header}\n1,4.0,0.1,2\n")
    assert main(["plot", str(path), "--out", str(tmp_path / "page.png")]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"unison: error: metrics file {path} has {missing}") and err.count("\n") == 0, err
    assert f"(its header: {', '.join(header.split(',')) if header else 'empty'})" in err, err
    assert not (tmp_path / "page.png").exists()
