"""`unison plan` at every method's defaults on 8 simulated ranks, at the image sizes `unison train` is tried at
(tests/training/test_defaults_matrix.py): 16 px (the embedded digits, and other 16 px data), 32, 64 and 224 px.

Always: the command's configuration path (flags -> `build_train_config` -> `plan_config`) and the build of the
simulated rank's step (`build_run` on rank 0 of `fake_cluster(8)`), where the recipe's defaults follow the image
size; a default that plan's own checks refuse fails here. The simulation of the step itself (memory, FLOPs, the
fake-CUDA path) costs 5-100 s per cell on this 2-core machine, so the whole ``unison plan`` per cell runs with
UNISON_LONG_TESTS=1.
"""

from __future__ import annotations

import os

import pytest

from unison.cli import main, make_parser
from unison.cli.train_args import build_train_config
from unison.data.synthetic import synthetic_dataset
from unison.methods import METHODS
from unison.models.vit import VIT_BACKBONES, vit_patch_size
from unison.plan import plan_config
from unison.plan.fake import fake_cluster
from unison.training.step import build_run

SIZES = ("digits", 16, 32, 64, 224)
VIT_AT = {16: "vit_tiny_p2", 32: "vit_tiny_p4", 64: "vit_tiny_p8", 224: "vit_tiny"}   # the recipes' vit_tiny_auto
LONG = os.environ.get("UNISON_LONG_TESTS") == "1"


def _argv(method: str, size: int | str) -> list[str]:
    data = ["--data", "digits", "--image-size", "16"] if size == "digits" else ["--data", "/data/images",
                                                                                 "--image-size", str(size)]
    teacher = ["--teacher", "random"] if method == "distill" else []
    return ["--method", method, *data, *teacher, "--world-size", "8", "--backend", "nccl"]


def _cell(method: str, size: int | str) -> str:
    return f"unison plan {' '.join(_argv(method, size))}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_plan_builds_every_method_at_its_defaults_on_8_ranks(method, size, one_torch_thread):
    try:
        ns = make_parser("plan").parse_args(["plan", *_argv(method, size)])
        cfg = plan_config(build_train_config(ns, cuda_available=True), ns.mfu)
        with fake_cluster(8) as (_, device):
            run = build_run(cfg, device, train_set=synthetic_dataset(cfg.batch_size, 8))
    except Exception as exc:
        pytest.fail(f"{_cell(method, size)}: its defaults are refused: {type(exc).__name__}: {exc}")
    backbone, views = run.resolved["backbone"], run.augment.view_sizes
    if backbone in VIT_BACKBONES and size != "digits":
        assert backbone == VIT_AT[int(size)], f"{_cell(method, size)}: {backbone}, not {VIT_AT[int(size)]}"
    if backbone in VIT_BACKBONES:
        assert all(v % vit_patch_size(backbone) == 0 for v in views), f"{_cell(method, size)}: {backbone} {views}"


@pytest.mark.skipif(not LONG, reason="the whole plan simulation per cell, 5-100 s each: UNISON_LONG_TESTS=1")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_unison_plan_runs_every_method_at_its_defaults_on_8_ranks(method, size, capfd):
    code = main(["plan", *_argv(method, size), "--json"])
    err = capfd.readouterr().err
    assert code == 0, f"{_cell(method, size)}: exit {code}: {err.strip()[-400:]}"
