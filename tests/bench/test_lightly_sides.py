"""`unison bench lightly --method M`: every method's Lightly side trains (2 steps on tiny digits, in this process,
through the bench's own code: `_lightly_child`), built from Lightly's modules; ``seed``/``all`` expand; a method
without a Lightly side is one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.lab.config import LIGHTLY_METHODS, config_from_overrides
from unison.bench.config import SEED_METHODS
from unison.errors import ConfigError

pytest.importorskip("lightly")

VIT_SIDES = ("mae", "msn", "pmsn", "simmim", "aim", "capi")   # trained on a ViT (the recipe's, `for_method`)


@pytest.mark.parametrize("method", LIGHTLY_METHODS)
def test_every_lightly_side_trains_two_steps(method, tmp_path):
    from benchmarks.lab.lightly_compare import _lightly_child

    backbone = "vit_nano_auto" if method in VIT_SIDES else "small_cnn"   # a ViT (`for_method`), tiny here
    batch = 128 if method == "wmse" else 8   # Lightly's WMSELoss needs a batch of its w_size
    payload = {"method": method, "data": "digits", "val": None, "subset": max(40, 2 * batch), "val_subset": 20,
               "seed": 0, "batch_size": batch, "steps": 2, "backbone": backbone, "loader_workers": 0, "threads": 1,
               "knn_k": 5, "device": "cpu", "amp": "none"}
    threads = torch.get_num_threads()
    try:
        _lightly_child(payload, str(tmp_path / "side.json"))
    finally:
        torch.set_num_threads(threads)
    r = json.loads((tmp_path / "side.json").read_text())
    assert r["steps"] == len(r["step_end_s"]) == 2, method
    assert math.isfinite(r["final_loss"]) and 0 <= r["knn_top1"] <= 1 and r["peak_memory_mib"] > 0, (method, r)
    optimizer = {"swav": "adam ", "vicreg": "lars ", "tico": "lars ", "wmse": "adam ", "empssl": "lars ",
                 **dict.fromkeys(VIT_SIDES, "adamw ")}.get(method, "sgd ")
    assert r["recipe"].startswith(optimizer), (method, r["recipe"])


def test_lightly_sides_are_lightlys_modules():
    from benchmarks.lab.lightly_methods import build_lightly_side
    from unison.models import build_backbone

    normalize = {"mean": [0.5] * 3, "std": [0.25] * 3}
    for method in LIGHTLY_METHODS:
        backbone, dim = build_backbone("vit_nano_p4" if method in VIT_SIDES else "small_cnn")
        side = build_lightly_side(method, backbone, dim, 32, normalize)
        assert type(side.transform).__module__.startswith("lightly.transforms"), method
        heads = [type(m).__module__ for m in side.model.modules() if m is not side.model and m is not backbone]
        assert any(h.startswith("lightly.") for h in heads), (method, heads)
        if method in ("vicregl", "densecl"):   # the shared backbone, its pooling removed (its map is needed)
            assert side.model.backbone.net is backbone
        elif method not in VIT_SIDES:   # the ViT methods: Lightly's wrappers around a timm ViT of the same architecture
            assert side.model.backbone is backbone   # the shared backbone, as unison's side builds it
    assert build_lightly_side("simsiam", *build_backbone("small_cnn"), 32, normalize).recipe.peak_lr(512) == 0.06
    assert build_lightly_side("moco", *build_backbone("small_cnn"), 32, normalize).recipe.peak_lr(512) == 0.24


def test_vicregs_lightly_side_uses_lars_without_decay_on_norms_and_biases():
    """Lightly's VICReg benchmark: LARS 0.2 x batch / 256, weight decay 1e-6 on the weights only."""
    from lightly.utils.lars import LARS

    from benchmarks.lab.lightly_methods import build_lightly_side
    from unison.models import build_backbone

    side = build_lightly_side("vicreg", *build_backbone("small_cnn"), 32, {"mean": [0.5] * 3, "std": [0.25] * 3})
    optimizer = side.recipe.optimizer_for(side.model, side.recipe.peak_lr(256))
    assert isinstance(optimizer, LARS) and optimizer.defaults["lr"] == pytest.approx(0.2)
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 1e-6 and not_decayed["weight_decay"] == 0.0
    assert all(q.ndim > 1 for q in decayed["params"]) and all(q.ndim == 1 for q in not_decayed["params"])
    assert len(decayed["params"]) + len(not_decayed["params"]) == len(list(side.model.parameters()))


def test_method_groups_and_a_method_without_a_lightly_side():
    assert config_from_overrides({"method": "seed"}).lightly_method_list == list(SEED_METHODS)
    assert config_from_overrides({"method": "all"}).lightly_method_list == list(LIGHTLY_METHODS)
    assert config_from_overrides({"method": "byol,seed"}).lightly_method_list[:2] == ["byol", "simclr"]
    assert config_from_overrides({"methods": "seed"}).method_list == list(SEED_METHODS)
    with pytest.raises(ConfigError, match="'ijepa' has no Lightly side"):
        config_from_overrides({"method": "ijepa"})


def test_dry_run_prints_each_methods_unison_side(capsys):
    from unison.bench.commands import _print_plan

    _print_plan(config_from_overrides({"method": "seed", "data": "cifar10", "val": "cifar10"}), ["lightly"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("unison train")]
    assert [ln.split("--method ")[1].split()[0] for ln in lines] == list(SEED_METHODS)
    assert all("--warmup-epochs 0" in ln for ln in lines)
    _print_plan(config_from_overrides({"method": "mae", "data": "cifar10", "val": "cifar10"}), ["lightly"])
    assert "--backbone vit_tiny_auto" in capsys.readouterr().out   # MAE needs patch tokens: its recipe's ViT


def test_report_has_a_row_pair_and_a_ratio_line_per_method(tmp_path):
    from benchmarks.lab.lightly_compare import write_lightly

    common = {"backbone": "small_cnn", "global_batch": 256, "steps": 40, "threads": 2, "train_time_s": 50.0,
              "wall_s": 70.0, "steady_from_step": 10, "peak_memory_mib": 900.0, "load_1m": 0.4, "version": "1",
              "error": None, "pipeline": "p", "loader_workers": 0}
    rows = [{"method": m, "side": side, "knn_top1": knn, "images_per_s": ips, "steady_images_per_s": ips, **common}
            for m in ("byol", "swav") for side, knn, ips in (("unison", 0.40, 300.0), ("lightly", 0.35, 100.0))]
    md = write_lightly(rows, tmp_path)["md"].read_text()
    assert md.count("| byol | ") == 2 and md.count("| swav | ") == 2
    assert "**byol: kNN unison - Lightly +0.050; throughput unison / Lightly 3.00x" in md
    assert "**swav: kNN unison - Lightly +0.050" in md


def test_two_seeds_a_side_judge_the_knn_difference_against_their_spread(tmp_path, capsys):
    from benchmarks.lab.lightly_compare import write_lightly
    from unison.bench.commands import _print_plan

    common = {"method": "moco", "backbone": "small_cnn", "global_batch": 256, "steps": 40, "threads": 2,
              "train_time_s": 50.0, "wall_s": 70.0, "steady_from_step": 10, "peak_memory_mib": 900.0,
              "load_1m": 0.4, "version": "1", "error": None, "pipeline": "p", "loader_workers": 0,
              "images_per_s": 100.0, "steady_images_per_s": 100.0}

    def report(unison: tuple[float, float], lightly: tuple[float, float]) -> str:
        rows = [{"side": side, "seed": seed, "knn_top1": knn, **common}
                for side, knns in (("unison", unison), ("lightly", lightly)) for seed, knn in enumerate(knns)]
        return write_lightly(rows, tmp_path)["md"].read_text()

    assert "(within noise: seed spread unison 0.020, Lightly 0.010)" in report((0.40, 0.42), (0.42, 0.43))
    assert "+0.050 (above:" in report((0.45, 0.46), (0.40, 0.41))
    assert "-0.050 (BELOW:" in report((0.40, 0.41), (0.45, 0.46))
    assert config_from_overrides({"seeds": "0,1"}).seed_list == [0, 1] and config_from_overrides({}).seed_list == [0]
    with pytest.raises(ConfigError, match="--seeds"):
        config_from_overrides({"seeds": "0;1"})
    _print_plan(config_from_overrides({"method": "byol", "seeds": "0,1", "data": "cifar10", "val": "cifar10"}),
                ["lightly"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("unison train")]
    assert [("--seed 0" in ln, "lightly-cmp-byol-unison-seed" in ln) for ln in lines] == [(True, True), (False, True)]


def test_the_lightly_sides_loader_workers_fork_as_a_lightly_users_do():
    """Lightly's side runs in a spawned process, whose DataLoader would spawn its workers (each re-importing torch
    and unpickling the data set every epoch); a Lightly user on Linux gets fork, and so must the side."""
    import multiprocessing as mp

    from benchmarks.lab.lightly_compare import user_loader_context

    assert user_loader_context(0) == {}   # DataLoader refuses a context without workers
    if "fork" in mp.get_all_start_methods():
        assert user_loader_context(4)["multiprocessing_context"].get_start_method() == "fork"


def test_the_knn_by_epoch_table_judges_each_epoch_against_its_own_spread():
    from benchmarks.lab.lightly_report import knn_by_epoch_markdown

    def row(side: str, seed: int, curve: list[list[float]]) -> dict:
        return {"method": "simclr", "global_batch": 256, "side": side, "seed": seed, "knn_by_epoch": curve}

    rows = [row("unison", 0, [[25, 0.40], [50, 0.50]]), row("unison", 1, [[25, 0.42], [50, 0.51]]),
            row("lightly", 0, [[25, 0.41], [50, 0.40]]), row("lightly", 1, [[25, 0.42], [50, 0.41]])]
    md = knn_by_epoch_markdown(rows)
    assert "| simclr | 256 | 25 | 0.400, 0.420 | 0.410, 0.420 | -0.005 | within noise (0.020) |" in md
    assert "| simclr | 256 | 50 | 0.500, 0.510 | 0.400, 0.410 | +0.100 | above (0.010) |" in md
    assert knn_by_epoch_markdown([{**r, "knn_by_epoch": None} for r in rows]) == ""


def test_eval_every_without_epochs_is_refused_and_the_dry_run_trains_whole_epochs(capsys):
    from unison.bench.commands import _print_plan

    with pytest.raises(ConfigError, match="--lightly-eval-every needs --lightly-epochs"):
        config_from_overrides({"lightly_eval_every": 25})
    with pytest.raises(ConfigError, match="--lightly-epochs 0"):
        config_from_overrides({"lightly_epochs": 0})
    _print_plan(config_from_overrides({"method": "simclr", "data": "cifar10", "val": "cifar10",
                                       "lightly_epochs": 100, "lightly_eval_every": 25}), ["lightly"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("unison train"))
    assert "--epochs 100" in line and "--eval-every 25" in line and "--max-steps" not in line
    assert "100 epochs of batch 256 (unison's side's steps), kNN every 25 epochs" in out
