"""`unison export` (backbone state dict loadable into torchvision), `unison eval` (kNN + linear probe), errors."""

import json

import pytest
import torch

from unison.cli import main
from unison.config import TrainConfig
from unison.eval.linear import linear_probe
from unison.methods import get_method
from unison.models import build_backbone
from unison.training.checkpoint import save_checkpoint


def _checkpoint(run_dir, backbone: str, image_size: int | None = None, backbone_args: dict | None = None,
                ) -> torch.nn.Module:
    """A freshly built SimCLR with non-trivial batch-norm statistics, saved as a unison checkpoint."""
    from unison.models.backbones import resolve_backbone

    torch.manual_seed(0)
    net, dim = build_backbone(backbone, image_size, backbone_args=backbone_args)
    cls = get_method("simclr")
    method = cls(net, dim, cls.Params())
    with torch.no_grad():  # eval-mode features then depend on every saved buffer, not just the weights
        for m in method.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    cfg = TrainConfig(backbone=backbone, image_size=image_size, backbone_args=backbone_args or {}).to_dict()
    state = {"method": "simclr", "config": cfg, "model": method.state_dict()}
    if image_size is not None:  # what a run records since the stem follows the image size
        state["resolved"] = {"backbone": resolve_backbone(backbone, image_size), "image_size": image_size}
    save_checkpoint(run_dir, state, step=0)
    return method.eval()


def test_export_resnet18_loads_into_torchvision_with_cifar_stem(tmp_path, capsys):
    import torchvision

    method = _checkpoint(tmp_path / "run", "resnet18")
    out = tmp_path / "r18.pt"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "torchvision.models.resnet18" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert "conv1.weight" in state and not any(k.startswith(("backbone.", "projector.", "fc.")) for k in state)

    tv = torchvision.models.resnet18()
    tv.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    tv.maxpool = torch.nn.Identity()
    missing, unexpected = tv.load_state_dict(state, strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and unexpected == []
    tv.fc = torch.nn.Identity()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(tv.eval()(x), method.backbone(x))


@pytest.mark.parametrize("backbone, args", [("timm:vit_tiny_patch16_224", {"patch_size": 4, "depth": 2}), ("vit_nano_p2", {})])
def test_export_prints_a_loading_call_that_loads_the_weights(tmp_path, capsys, backbone, args):
    """A timm ViT trained at 16 px with 4 px patches: the printed ``timm.create_model(name, num_classes=0)`` failed
    (pos_embed and patch_embed of another size). The call printed (and in the sidecar) takes the weights strictly and
    gives the backbone's features; unison's own ViTs load into timm's VisionTransformer the same way."""
    import json
    import re

    import timm

    method = _checkpoint(tmp_path / "run", backbone, 16, args)
    out = tmp_path / "vit.pt"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    call = re.search(r"; load into (.*?); inputs 16 px", capsys.readouterr().out).group(1)
    model = eval(call, {"timm": timm})
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), method.backbone(x))
    assert call == json.loads(out.with_suffix(".json").read_text())["load"]
    assert ("patch_size=4" in call and "img_size=16" in call) if args else "VisionTransformer(" in call


def test_export_resnet18_at_imagenet_size_loads_into_plain_torchvision(tmp_path, capsys):
    import torchvision

    method = _checkpoint(tmp_path / "run", "resnet18", image_size=96)
    out = tmp_path / "r18.pt"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "resnet18_imagenet" in capsys.readouterr().out
    tv = torchvision.models.resnet18()               # no stem surgery: torchvision's own ImageNet stem
    missing, unexpected = tv.load_state_dict(torch.load(out, weights_only=True), strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and unexpected == []
    tv.fc = torch.nn.Identity()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        assert torch.equal(tv.eval()(x), method.backbone(x))


def test_export_safetensors_or_clear_error(tmp_path, capsys):
    _checkpoint(tmp_path / "run", "small_cnn")
    out = tmp_path / "bb.safetensors"
    rc = main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert rc == 2 and "pip install safetensors" in capsys.readouterr().err and not out.exists()
        return
    assert rc == 0 and set(load_file(str(out))) == set(build_backbone("small_cnn")[0].state_dict())


@pytest.mark.parametrize("command", ["eval", "export"])
def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys, command):
    extra = ["--out", str(tmp_path / "x.pt")] if command == "export" else []
    assert main([command, "--checkpoint", str(tmp_path / "nope"), *extra]) == 4   # CheckpointError
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and str(tmp_path / "nope") in err


def test_linear_probe_is_seeded_and_learns_separable_features():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 16, generator=g) * 3
    y = torch.arange(500) % 5
    x = centres[y] + torch.randn(500, 16, generator=g)
    rng = torch.get_rng_state()
    a = linear_probe(x[:400], y[:400], x[400:], y[400:], 5, epochs=10, seed=1)
    b = linear_probe(x[:400], y[:400], x[400:], y[400:], 5, epochs=10, seed=1)
    assert a == b and a.top1 > 0.9
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched


EVAL_OPTION_CASES = [   # each was accepted before (--knn-t 1e-30 overflowed the kNN weights into a garbage top-1)
    (["--knn-t", "1e-30"], "knn_t=1e-30 must be a finite number >= 0.02"),
    (["--linear-lr", "1e400"], "linear_lr=inf must be a finite number > 0 and <= 1000000"),
    (["--subset", "0"], "subset=0 must be an integer >= 1"),
    (["--seed", "-1"], "seed=-1 must be an integer in [0, 2**64-1]"),
]


@pytest.mark.parametrize("argv, fragment", EVAL_OPTION_CASES, ids=[c[0][0] for c in EVAL_OPTION_CASES])
def test_eval_options_have_the_ranges_train_states(tmp_path, capsys, argv, fragment):
    """`unison eval` checks its options with train's field checks and ranges (one rule for both commands)."""
    assert main(["eval", "--checkpoint", str(tmp_path / "nope"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("unison: error:") == 1 and fragment in err and "Traceback" not in err, err


def _images(root, labelled: bool, n: int = 8) -> str:
    from PIL import Image

    for i in range(n):
        path = root / (f"c{i % 2}/{i}.png" if labelled else f"{i}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (30 * i, 255 - 30 * i, 0)).save(path)
    return str(root)


def _eval(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["eval", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


@pytest.mark.parametrize("unlabelled, probe", [("data", ["--no-linear"]), ("val", ["--no-knn", "--linear-epochs", "1"]),
                                               ("both", ["--no-knn", "--linear-epochs", "1"])])
def test_eval_on_unlabelled_data_is_one_line(tmp_path, capsys, unlabelled, probe):
    """kNN and the probe score predicted classes: a flat folder of images has none (an index error on the old code)."""
    _checkpoint(tmp_path / "run", "small_cnn")
    data = _images(tmp_path / "data", labelled=unlabelled == "val")
    val = _images(tmp_path / "val", labelled=unlabelled == "data")
    flag, path = ("--val", val) if unlabelled == "val" else ("--data", data)
    code, line = _eval(["--checkpoint", str(tmp_path / "run"), "--data", data, "--val", val, *probe], capsys)
    assert code == 2 and line == (f"unison: error: {flag} {path} has no class labels; kNN and the linear probe need "
                                  "them: an ImageFolder (one subfolder per class), a labelled file list or shards "
                                  "with .cls")


def test_eval_elsewhere_names_the_runs_recorded_relative_data(tmp_path, capsys, monkeypatch):
    net, dim = build_backbone("small_cnn", None)
    cls = get_method("simclr")
    state = {"method": "simclr", "config": TrainConfig(backbone="small_cnn", data="imf", val="imv").to_dict(),
             "model": cls(net, dim, cls.Params()).state_dict()}
    save_checkpoint(tmp_path / "runs" / "x", state, step=1)
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    code, line = _eval(["--checkpoint", "../runs/x", "--no-linear"], capsys)
    assert code == 2 and line == (f"unison: error: imf is the run's recorded --data, relative to the folder the run "
                                  f"was started in, and there is no {tmp_path}/other/imf from here: run unison eval "
                                  "from that folder, or pass --data and --val")


# -- with real processes --

def test_eval_on_a_trained_run_prints_knn_and_linear_and_writes_json(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-steps", "3", "--batch-size", "64", "--no-progress",
                 "--world-size", "1", "--threads", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run), "--linear-epochs", "30", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "kNN top-1" in out and "linear top-1" in out
    result = json.loads(report.read_text())
    assert 0.0 <= result["knn_top1"] <= 1.0 and 0.0 <= result["linear_top1"] <= 1.0
    assert result["step"] == 3 and result["method"] == "simclr"
    # Same checkpoint, data and k/t as the loop's final kNN: the same number.
    summary = json.loads((run / "summary.json").read_text())
    assert abs(result["knn_top1"] - summary["knn_top1"]) < 1e-9
    assert f"{result['knn_top1']:.4f}" in out and f"{result['linear_top1']:.4f}" in out


def test_eval_never_scores_a_folder_against_itself(tmp_path, capfd):
    """A run on a folder without --val has no held-out data: `unison eval` used to score the kNN and the linear
    probe on the very images they fit (the folder twice: about 100 %); now it asks for --val, and refuses a --val
    that overlaps --data."""
    from unison.data.generated import write_image_folder

    write_image_folder(tmp_path / "train", 32, classes=2, sizes=(16, 16), seed=0)
    write_image_folder(tmp_path / "held", 16, classes=2, sizes=(16, 16), seed=1)
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train"), "--max-steps", "1", "--batch-size", "16",
                 "--no-progress", "--world-size", "1", "--out", str(run)]) == 0
    capfd.readouterr()
    fast = ["--linear-epochs", "2", "--knn-k", "5"]
    for extra, fragment in (([], "no held-out data: --data"), (["--val", str(tmp_path / "train" / "class_0")],
                                                                 "overlaps the training data")):
        assert main(["eval", "--checkpoint", str(run), *fast, *extra]) != 0
        err = capfd.readouterr().err
        assert err.count("unison: error:") == 1 and fragment in err and "Traceback" not in err, err
    assert main(["eval", "--checkpoint", str(run), *fast, "--val", str(tmp_path / "held")]) == 0
    from PIL import Image

    for c in ("class_0", "class_1"):   # 4000 x 1 strips: eval embeds at the run's image size (it took the width: 32 GB)
        (tmp_path / "strips" / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (4000, 1), (60 * i, 0, 0)).save(tmp_path / "strips" / c / f"{i}.png")
    assert main(["eval", "--checkpoint", str(run), *fast, "--val", str(tmp_path / "strips")]) == 0
