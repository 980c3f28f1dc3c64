"""The Python API as a Lightly/LightlyTrain user meets it: `dir(unison)` lists plain functions with keyword
arguments (`load_backbone`, `evaluate`, `embed`, `export`), each taking a run path; and a run of your own backbone
and dataset gets an accuracy number (labelled ``dataset=``/``val=`` objects; ``unison eval`` rebuilds the backbone
when its class can be imported, one line when it cannot). Runs are in-process at one worker, a few steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers.own_pieces import WIDTH, Photos, TinyNet

import unison
from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.data.generated import write_image_folder
from unison.errors import ConfigError
from unison.evaluation import EvalOptions

API = ("load_backbone", "evaluate", "embed", "export", "train", "check")
TINY = ["train", "--world-size", "1", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5",
        "--no-progress", "--no-random-init-knn", "--signal-images", "0", "--max-steps", "2", "--threads", "1"]


class NeedsWidth(nn.Module):
    """A backbone whose class takes an argument: `unison eval` cannot build it alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = TinyNet()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_dir_shows_the_api_with_examples():
    import unison.export  # noqa: F401  (the module of `unison export`: the function keeps its name)

    for name in API:
        assert name in dir(unison), dir(unison)
        assert "Example" in (getattr(unison, name).__doc__ or ""), name


def test_import_unison_stays_light():
    import subprocess
    import sys

    code = "import sys, unison; print(sorted(m for m in ('torch', 'unison.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "run"
    assert main([*TINY, "--out", str(out)]) == 0
    return out


@pytest.mark.distributed
def test_load_backbone_evaluate_embed_export_take_a_run_path(run, tmp_path, one_torch_thread):
    net = unison.load_backbone(run)
    assert isinstance(net, nn.Module) and not net.training
    dim = net(torch.zeros(2, 3, 16, 16)).shape
    assert dim[0] == 2

    scores = unison.evaluate(run, knn_k=5, linear_epochs=2)
    assert 0 <= scores["knn_top1"] <= 1 and 0 <= scores["linear_top1"] <= 1
    same = unison.evaluate(EvalOptions(checkpoint=str(run), knn_k=5, linear=False))   # the options object still works
    assert same["knn_top1"] == scores["knn_top1"] and same["linear_top1"] is None
    with pytest.raises(ConfigError, match="unknown option.*knnk"):
        unison.evaluate(run, knnk=5)

    write_image_folder(tmp_path / "photos", 6, classes=2, sizes=(16, 16), seed=3)
    r = unison.embed(run, tmp_path / "photos")
    assert r["features"].shape == (6, dim[1]) and r["features"].dtype == np.float32 and len(r["files"]) == 6
    written = unison.embed(run, tmp_path / "photos", tmp_path / "f.npy", batch_size=4)
    assert np.array_equal(np.load(written["out"]), r["features"])

    info = unison.export(run, tmp_path / "backbone.pt")
    fresh = unison.load_backbone(run)
    fresh.load_state_dict(torch.load(info["path"]))
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(fresh(x), net(x))


@pytest.mark.distributed
def test_load_backbone_loads_the_runs_weights_into_the_module_given_or_says_why_not(run, one_torch_thread):
    from unison.models.backbones import build_backbone

    trained = unison.load_backbone(run)
    mine, _ = build_backbone("small_cnn")   # the run's architecture, other (random) weights
    x = torch.rand(2, 3, 16, 16)
    assert not torch.equal(mine.eval()(x), trained(x))
    got = unison.load_backbone(run, backbone=mine)
    assert got is mine and not got.training   # the module given, with the run's weights
    assert torch.equal(got(x), trained(x))
    with pytest.raises(ConfigError, match=r"backbone= \(Linear\) does not fit the trained backbone of .*\(small_cnn\): "
                                          r"2 keys of backbone= missing from the run's small_cnn \(weight, bias\)"):
        unison.load_backbone(run, backbone=nn.Linear(3, 3))
    with pytest.raises(ConfigError, match=r"backbone='resnet18' \(str\) must be an nn.Module or None"):
        unison.load_backbone(run, backbone="resnet18")


@pytest.mark.distributed
def test_a_device_that_is_not_one_or_not_here_is_said_as_such_not_blamed_on_the_checkpoint(run):
    from unison.training.checkpoint import load_checkpoint

    with pytest.raises(ConfigError, match=r"^device='garbage' is not a device; give cpu, cuda or cuda:N \(or auto\)$"):
        unison.load_backbone(run, device="garbage")
    with pytest.raises(ConfigError, match="map_location='garbage' is not a device"):
        load_checkpoint(run, map_location="garbage")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^device='cuda' but no CUDA device is available; use device='cpu'$"):
            unison.load_backbone(run, device="cuda")
        with pytest.raises(ConfigError, match=r"^--device cuda but no CUDA device is available; use --device cpu$"):
            EvalOptions(checkpoint=str(run), device="cuda").validate()   # the CLI's line, from the same check


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    cfg = TrainConfig(method="simclr", batch_size=16, max_steps=2, random_init_knn=False, signal_images=0,
                      progress=False, out=str(out / "run"), distributed=DistributedConfig(world_size=1))
    unison.train(cfg, backbone=TinyNet(), feature_dim=WIDTH, dataset=Photos(32))
    return out / "run"


def test_your_own_dataset_gets_an_accuracy_number(own_run, one_torch_thread):
    scores = unison.evaluate(own_run, dataset=Photos(48, seed=1), val=Photos(24, seed=2), knn_k=5, linear_epochs=2)
    assert 0 <= scores["knn_top1"] <= 1 and 0 <= scores["linear_top1"] <= 1
    assert scores["train_images"] == 48 and scores["val_images"] == 24


def test_unison_eval_rebuilds_your_backbone_when_its_class_imports(own_run, tmp_path, capsys, one_torch_thread):
    write_image_folder(tmp_path / "train", 12, classes=2, sizes=(12, 12), seed=1)
    write_image_folder(tmp_path / "val", 6, classes=2, sizes=(12, 12), seed=2)
    paths = ["--data", str(tmp_path / "train"), "--val", str(tmp_path / "val"), "--knn-k", "3", "--linear-epochs", "2"]
    assert main(["eval", "--checkpoint", str(own_run), *paths]) == 0
    assert "kNN top-1" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(own_run)]) == 2   # the run's own dataset cannot be read again
    assert "give --data and --val" in capsys.readouterr().err


def test_a_backbone_class_that_needs_arguments_is_one_line(tmp_path, capsys, one_torch_thread):
    cfg = TrainConfig(method="simclr", batch_size=16, max_steps=1, random_init_knn=False, signal_images=0,
                      progress=False, out=str(tmp_path / "run"), distributed=DistributedConfig(world_size=1))
    unison.train(cfg, backbone=NeedsWidth(8), feature_dim=WIDTH, dataset=Photos(16))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", "digits"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NeedsWidth() fails" in err[0] and "backbone=NeedsWidth(...)" in err[0], err
    scores = unison.evaluate(tmp_path / "run", backbone=NeedsWidth(8), dataset=Photos(24), val=Photos(12, seed=2),
                             knn_k=3, linear=False)
    assert 0 <= scores["knn_top1"] <= 1


def test_train_with_your_own_dataset_and_a_held_out_dataset_reports_knn(tmp_path, one_torch_thread):
    cfg = TrainConfig(method="simclr", batch_size=16, max_steps=2, knn_k=5, signal_images=0, progress=False,
                      out=str(tmp_path / "run"), distributed=DistributedConfig(world_size=1))
    summary = unison.train(cfg, backbone=TinyNet(), feature_dim=WIDTH, dataset=Photos(32), val=Photos(12, seed=2))
    assert summary.knn_top1 is not None and 0 <= summary.knn_top1 <= 1
    assert summary.random_init_knn_top1 is not None
    with pytest.raises(ConfigError, match="val= holds the held-out images of dataset="):
        unison.train(cfg, val=Photos(12))
