"""The front door as a new user meets it (issue 15): each defect and friction, checked as the user would.

Defects 1, 3-6 and 8 (2 and 7 are tested beside the data and the signal handling) and the frictions
9-16 (18: `test_cifar10_download_failure_is_a_clear_error` in tests/unit/data/test_data.py). One real 2-worker
run (`two_workers`, a subprocess, as a user starts it) is shared by the checks that read its output;
torchrun is started for real.
"""

from __future__ import annotations

import pytest

from unison.cli import main
from unison.cli.train_args import parse_train_args


# ------------------------------------------------------------------ defects
def test_1_scientific_notation_is_a_float_in_yaml_and_param(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1e-3\nweight_decay: 5e-4\nwarmup_epochs: 1e0\nmethod: byol\n")
    cfg = parse_train_args(["--config", str(config), "--param", "momentum_base=1e-2"])
    assert (cfg.lr, cfg.weight_decay, cfg.warmup_epochs) == (1e-3, 5e-4, 1.0)
    assert cfg.method_params == {"momentum_base": 0.01}
    assert isinstance(cfg.method_params["momentum_base"], float)


def test_6_plot_of_a_short_run_shows_its_points_and_the_baseline():
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


def test_10_version(capsys):
    from unison import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"unison {__version__} (torch ")
