"""Multi-crop sizes against the backbone (issue 22, defect 4), checked before any worker starts, and the
multi-crop settings on the command line (--local-crops, --local-crop-size)."""

from __future__ import annotations

import pytest
import torch

from unison.cli import main
from unison.cli.train_args import parse_train_args
from unison.errors import ConfigError
from unison.models.backbones import build_backbone, check_backbone
from unison.training.resolve import plan_run

_TINY = ["train", "--world-size", "1", "--max-steps", "1", "--batch-size", "8", "--subset", "32", "--val-subset", "16",
         "--knn-k", "5", "--no-progress", "--no-random-init-knn", "--method", "dino"]


def _refused(argv, capsys, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("unison: error:") == 1 and "Traceback" not in err
    return err


def test_patch16_timm_vit_with_14px_local_crops_is_refused_before_workers(tmp_path, capsys):
    pytest.importorskip("timm")
    out = tmp_path / "r"
    err = _refused([*_TINY, "--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32", "--local-crop-size", "14",
                    "--out", str(out)], capsys)
    assert "local crops of 14 px are not a multiple of the patch size 16" in err and "--local-crop-size" in err
    assert not out.exists()   # the pre-flight refused it: no worker, no run directory


def test_builtin_vit_local_crops_checked_and_fixed_size_timm_refused():
    pytest.importorskip("timm")
    with pytest.raises(ConfigError, match="not a multiple of the patch size 4 of vit_tiny_p4"):
        check_backbone("vit_tiny_p4", 32, {}, [32, 32, 14])
    check_backbone("vit_tiny_p4", 32, {}, [32, 32, 16])
    check_backbone("timm:vit_base_patch16_224", 224, {}, [224, 224, 96, 96])   # built with dynamic_img_size
    with pytest.raises(ConfigError, match="takes only 224 px inputs and the local crops are 96 px"):
        check_backbone("timm:vit_base_patch16_224", 224, {"dynamic_img_size": False}, [224, 224, 96])


def test_timm_vit_takes_local_crops_of_another_size():
    pytest.importorskip("timm")
    net, dim = build_backbone("timm:vit_tiny_patch16_224", 32, backbone_args={"depth": 1},
                              view_sizes=[32, 32, 16])
    assert net(torch.zeros(2, 3, 16, 16)).shape == (2, dim) == net(torch.zeros(2, 3, 32, 32)).shape
    single, _ = build_backbone("timm:vit_tiny_patch16_224", 32, backbone_args={"depth": 1}, view_sizes=[32, 32])   # one size: as before
    assert not getattr(single, "dynamic_img_size", False)


def test_local_crop_settings_on_the_command_line(capsys, tmp_path):
    cfg = parse_train_args(["--method", "dino", "--local-crops", "2", "--local-crop-size", "8"])
    assert (cfg.local_crops, cfg.local_crop_size) == (2, 8)
    assert plan_run(cfg).view_sizes == (16, 16, 8, 8)
    cfg = parse_train_args(["--method", "dino", "--local-crops", "0"])
    assert plan_run(cfg).view_sizes == (16, 16)
    err = _refused([*_TINY, "--local-crops", "99", "--out", str(tmp_path / "a")], capsys)
    assert "--local-crops" in err or "local_crops" in err
    err = _refused([*_TINY, "--local-crop-size", "4", "--out", str(tmp_path / "b")], capsys)
    assert "local_crop_size" in err or "--local-crop-size" in err
    err = _refused([*_TINY, "--method", "simclr", "--local-crops", "2", "--out", str(tmp_path / "c")], capsys)
    assert "simclr with the digits augmentation has none" in err


def test_ijepa_targets_that_leave_no_context_are_refused_before_workers(tmp_path, capsys):
    """The method's own view rule (`SSLMethod.check_views`) in the pre-flight: it was found by the first step."""
    out = tmp_path / "r"
    err = _refused(["train", "--world-size", "1", "--data", "digits", "--method", "ijepa", "--backbone", "vit_nano_p4",
                    "--no-progress", "--out", str(out)], capsys)
    assert "no context is left" in err and not out.exists()
