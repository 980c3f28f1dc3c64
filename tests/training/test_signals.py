"""Label-free signals against reference formulas, collapse caught, the online probe, `unison plot`.

The label-free signals and the online probe are the same at world size 1 and 2 (real worker processes)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from unison.cli import main
from unison.training.checkpoint import load_checkpoint
from unison.training.signals import alignment, embedding_std, held_back_indices, rankme, uniformity

TINY = ["train", "--world-size", "1", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5",
        "--no-progress", "--no-random-init-knn", "--signal-images", "128"]

Z = torch.randn(40, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
Z2 = Z + 0.3 * torch.randn(40, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ the formulas
def test_signals_equal_straightforward_reference_formulas():
    z, z2 = Z.numpy(), Z2.numpy()
    s = np.linalg.svd(z, compute_uv=False)
    p = s / s.sum() + 1e-7
    assert rankme(Z) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-12)
    zn = z / np.linalg.norm(z, axis=1, keepdims=True)
    z2n = z2 / np.linalg.norm(z2, axis=1, keepdims=True)
    assert embedding_std(Z) == pytest.approx(zn.std(axis=0).mean() * math.sqrt(8), rel=1e-12)
    assert alignment(Z, Z2) == pytest.approx(np.mean([np.sum((a - b) ** 2) for a, b in zip(zn, z2n)]), rel=1e-12)
    pairs = [math.exp(-2 * np.sum((zn[i] - zn[j]) ** 2)) for i in range(40) for j in range(i + 1, 40)]
    assert uniformity(Z) == pytest.approx(math.log(sum(pairs) / len(pairs)), rel=1e-12)
    collapsed = torch.ones(40, 8) * torch.arange(1.0, 9.0)   # every image on one point
    assert rankme(collapsed) == pytest.approx(1.0, abs=1e-4) and embedding_std(collapsed) == pytest.approx(0, abs=1e-7)
    assert uniformity(collapsed) == pytest.approx(0, abs=1e-12) and alignment(collapsed, collapsed) == 0
    assert rankme(torch.eye(8)) == pytest.approx(8, rel=1e-5)   # a flat spectrum: the full rank


def test_held_back_set_depends_on_the_seed_only():
    a = held_back_indices(1000, 100, seed=7)
    assert len(a) == 100 and len(set(a.tolist())) == 100 and a.max() < 1000 and (np.diff(a) > 0).all()
    assert (a == held_back_indices(1000, 100, seed=7)).all() and not (a == held_back_indices(1000, 100, seed=8)).all()
    assert len(held_back_indices(30, 100, seed=7)) == 30


# ------------------------------------------------------------------ runs shared by the tests below
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same 20-step run with and without the online probe (the signals every 5 steps in both)."""
    root = tmp_path_factory.mktemp("runs")
    for name, probe in (("probe", "--online-probe"), ("plain", "--no-online-probe")):
        assert main([*TINY, "--max-steps", "20", "--log-every", "4", "--signals-every", "5", "--warmup-epochs", "0",
                     probe, "--out", str(root / name)]) == 0
    return root


# ------------------------------------------------------------------ collapse
@pytest.mark.slow   # 2 to 4 short runs: about 15 s on an idle 2-core machine, 2 min under a load of 10
def test_collapsing_run_warns_and_stops(tmp_path, capsys):
    bad = tmp_path / "bad"
    # weight decay 2 without warm-up: the embedding shrinks to one point within 3 steps
    assert main([*TINY, "--max-steps", "6", "--signals-every", "1", "--no-online-probe", "--warmup-epochs", "0",
                 "--weight-decay", "2", "--stop-on-collapse", "--out", str(bad)]) == 0
    out, err = capsys.readouterr()
    warnings = [ln for ln in err.splitlines() if "collapsed" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("unison: warning: the representation collapsed by step ")
    assert "embedding std" in warnings[0] and "--lr" in warnings[0] and "Traceback" not in err
    summary = json.loads((bad / "summary.json").read_text())
    step = summary["signals"]["collapse"]["step"]
    assert step <= 4 and summary["steps"] == step and summary["signals"]["stopped_on_collapse"]
    assert load_checkpoint(bad)["step"] == step                      # the checkpoint of where it stopped is kept
    assert f"{step} steps (stopped on collapse)" in out and "collapsed at step" in out


@pytest.mark.slow   # 2 to 4 short runs: about 15 s on an idle 2-core machine, 2 min under a load of 10
def test_healthy_run_does_not_warn(two_runs):
    log = (two_runs / "plain" / "train.log").read_text()
    assert "collapsed" not in log
    signals = [r for r in _rows(two_runs / "plain") if r["rankme"]]
    assert [int(r["step"]) for r in signals] == [0, 5, 10, 15, 20]    # start, every 5 steps, the end
    assert all(float(r["emb_std"]) > 0.05 for r in signals)
    assert json.loads((two_runs / "plain" / "summary.json").read_text())["signals"]["collapse"] is None


# ------------------------------------------------------------------ the online probe
@pytest.mark.slow   # 2 to 4 short runs: about 15 s on an idle 2-core machine, 2 min under a load of 10
def test_probe_learns_and_leaves_the_encoder_bit_identical(two_runs):
    with_probe, without = (load_checkpoint(two_runs / p)["model"] for p in ("probe", "plain"))
    assert with_probe.keys() == without.keys()
    for k in with_probe:   # parameters and buffers (batch-norm statistics) alike
        assert torch.equal(with_probe[k], without[k]), k
    accuracy = [float(r["probe_top1"]) for r in _rows(two_runs / "probe") if r["probe_top1"]]
    assert accuracy[-1] > 0.3, accuracy    # 10 classes: chance is 0.1 (about 0.5 here at steps 17-20)
    assert not any(r["probe_top1"] for r in _rows(two_runs / "plain"))
    assert json.loads((two_runs / "probe" / "summary.json").read_text())["probe_top1"] == accuracy[-1]


# ------------------------------------------------------------------ unison plot
@pytest.mark.slow   # 2 to 4 short runs: about 15 s on an idle 2-core machine, 2 min under a load of 10
def test_unison_plot_overlays_two_runs(two_runs, capsys):
    out = two_runs / "both.png"
    assert main(["plot", str(two_runs / "probe"), str(two_runs / "plain" / "metrics.csv"), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
    assert main(["plot", str(two_runs / "probe"), "--out", str(out)]) == 2   # never silently replaced
    assert main(["plot", str(two_runs / "probe"), "--out", str(out), "--overwrite"]) == 0   # when asked


def _refused(argv: list[str], capsys, code: int, fragment: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("unison: error:") == 1 and "Traceback" not in err and fragment in err, err


@pytest.mark.slow   # 2 to 4 short runs: about 15 s on an idle 2-core machine, 2 min under a load of 10
def test_unison_plot_bad_inputs_are_one_line(two_runs, tmp_path, capsys):
    a = str(two_runs / "probe")
    other = tmp_path / "other.png"
    other.write_bytes(b"\x89PNG not ours")
    _refused(["plot", a, "--out", str(other)], capsys, 2, "already exists")
    assert other.read_bytes() == b"\x89PNG not ours"
    _refused(["plot", a, "--out", str(two_runs / "probe" / "x.png")], capsys, 2, "lies inside")
    _refused(["plot", a, "--out", str(tmp_path / "x.pdf")], capsys, 2, "must end in .png")
    _refused(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")], capsys, 2, "does not exist")
    _refused(["plot", "--out", str(tmp_path / "x.png")], capsys, 2, "at least one run")
    bad = tmp_path / "bad.csv"
    bad.write_text("step,epoch,loss\n1,0.1,abc\n")
    _refused(["plot", str(bad), "--out", str(tmp_path / "x.png")], capsys, 3, "line 2, column loss")
    bad.write_bytes(b"step,epoch\n\xff\xfe\n")
    _refused(["plot", str(bad), "--out", str(tmp_path / "x.png")], capsys, 3, "not UTF-8")
    bad.write_text("hello\n")
    _refused(["plot", str(bad), "--out", str(tmp_path / "x.png")], capsys, 3,
             "has no 'step' and no 'epoch' column (its header: hello)")
    _refused(["plot", "/dev/null", "--out", str(tmp_path / "x.png")], capsys, 3, "not a regular file")
    assert not (tmp_path / "x.png").exists()


# -- with real processes --

RUN = ["train", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
       "--no-random-init-knn", "--signal-images", "100", "--signals-every", "1", "--max-steps", "2", "--log-every", "1",
       "--precision", "float64", "--warmup-epochs", "0"]
SIGNALS = ("rankme", "emb_std", "align", "uniform")


def _signal_rows(run) -> list[dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.distributed
@pytest.mark.slow
def test_signals_and_probe_are_the_same_at_world_size_1_and_2(tmp_path):
    runs = {}
    for w in (1, 2):
        runs[w] = tmp_path / f"w{w}"
        assert main([*RUN, "--world-size", str(w), "--out", str(runs[w])]) == 0
    signals = {w: [r for r in _signal_rows(runs[w]) if r["rankme"]] for w in runs}
    assert [int(r["step"]) for r in signals[1]] == [int(r["step"]) for r in signals[2]] == [0, 1, 2]
    # 100 images: two chunks, embedded by one rank at W=1 and one each at W=2, gathered in the same order
    for k in SIGNALS:   # the same weights at step 0: the same numbers, bit for bit
        assert signals[1][0][k] == signals[2][0][k], k
    for r1, r2 in zip(signals[1][1:], signals[2][1:]):   # after steps: W=2 differs from W=1 by summation order only
        for k in SIGNALS:
            assert float(r1[k]) == pytest.approx(float(r2[k]), rel=1e-9), k
    probe = {w: [float(r["probe_top1"]) for r in _signal_rows(runs[w]) if r["probe_top1"]] for w in runs}
    assert len(probe[1]) == 2 and probe[1] == pytest.approx(probe[2], abs=1e-12)
