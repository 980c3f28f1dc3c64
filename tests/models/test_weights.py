"""`unison.models.weights`: torchvision / timm / safetensors / unison-export weights into a unison backbone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from unison.errors import CheckpointError
from unison.models import build_backbone
from unison.models.weights import load_backbone_weights, read_backbone_state


@pytest.fixture(scope="module")
def tv18(tmp_path_factory) -> tuple[nn.Module, Path]:
    """torchvision's resnet18, random-initialised from a seed (fc replaced by Identity after saving), and its file."""
    import torchvision

    torch.manual_seed(7)
    model = torchvision.models.resnet18()
    path = tmp_path_factory.mktemp("tv") / "resnet18.pth"
    torch.save(model.state_dict(), path)
    model.fc = nn.Identity()
    return model.eval(), path


def _features(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net.eval()(x)


def test_torchvision_state_dict_gives_torchvisions_features(tv18):
    model, path = tv18
    net, _ = build_backbone("resnet18_imagenet")
    report = load_backbone_weights(net, path, name="resnet18_imagenet")
    assert report.skipped == ["fc.weight", "fc.bias"] and report.matched == len(net.state_dict())
    assert "skipped: fc.weight, fc.bias" in report.line()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_features(net, x), _features(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("wrap", ["module.", "model.backbone.", "state_dict"])
def test_prefixes_and_wrappers_are_stripped(tmp_path, wrap):
    model, _ = build_backbone("small_cnn")
    sd = model.state_dict()
    obj = {"state_dict": sd, "epoch": 3} if wrap == "state_dict" else {wrap + k: v for k, v in sd.items()}
    if wrap == "model.backbone.":
        obj["model.head.0.weight"] = torch.zeros(4, 4)   # an SSL checkpoint's projection head: skipped
    torch.save(obj, tmp_path / "w.pt")
    net, _ = build_backbone("small_cnn")
    report = load_backbone_weights(net, tmp_path / "w.pt")
    assert report.matched == len(net.state_dict())
    assert report.prefix == ("" if wrap == "state_dict" else wrap)
    if wrap == "model.backbone.":
        assert report.skipped == ["model.head.0.weight"]


def test_safetensors_and_unison_export_sidecar(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    src, _ = build_backbone("small_cnn")
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "b.safetensors"))
    (tmp_path / "b.json").write_text(json.dumps({"unison": "backbone", "file": "b.safetensors",
                                                 "backbone": "small_cnn", "method": "simclr", "step": 4}))
    net, _ = build_backbone("small_cnn")
    report = load_backbone_weights(net, tmp_path / "b.safetensors")
    assert report.source == "unison export (small_cnn, simclr, step 4)" and not report.skipped
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(_features(net, x), _features(src, x), rtol=0, atol=0)
    assert set(read_backbone_state(tmp_path / "b.safetensors")) == set(src.state_dict())


class _Evil:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code in a weights file."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _refused(net: nn.Module, path: Path, fragment: str, **kw) -> str:
    with pytest.raises(CheckpointError) as info:
        load_backbone_weights(net, path, **kw)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    return message


def test_crafted_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"conv1.weight": _Evil(marker)}, tmp_path / "evil.pt")
    net, _ = build_backbone("small_cnn")
    _refused(net, tmp_path / "evil.pt", "could run code when unpickled")
    assert not marker.exists()


def test_mismatches_are_named(tv18, tmp_path):
    _, path = tv18
    cifar, _ = build_backbone("resnet18_cifar")
    message = _refused(cifar, path, "'conv1.weight' is [64, 3, 7, 7] in the file", name="resnet18_cifar")
    assert "--backbone resnet18_imagenet" in message
    cnn, _ = build_backbone("small_cnn")
    _refused(cnn, path, "none of its")
    sd = {k: v for k, v in cnn.state_dict().items() if k != "features.10.weight"}
    torch.save(sd, tmp_path / "less.pt")
    _refused(cnn, tmp_path / "less.pt", "has no tensor 'features.10.weight' that the backbone has (1 missing)")
    torch.save({**cnn.state_dict(), "features.12.weight": torch.zeros(1)}, tmp_path / "more.pt")
    _refused(cnn, tmp_path / "more.pt", "has tensor 'features.12.weight' that the backbone lacks")


def test_vit_position_embedding_is_resampled_to_the_grid(tmp_path):
    """Weights trained at another image size: pos_embed resampled as timm does (reported); another patch size or
    width is named."""
    from timm.layers import resample_abs_pos_embed

    src, _ = build_backbone("vit_nano_p4")   # 32 px, 8x8 patches of 4 px
    torch.save(src.state_dict(), tmp_path / "vit.pt")
    net, _ = build_backbone("vit_nano_p2")   # 16 px, 8x8 patches of 2 px: the patch embedding differs
    _refused(net, tmp_path / "vit.pt", "4 px patches")
    sd = dict(src.state_dict())
    sd["pos_embed"] = torch.randn(1, 1 + 14 * 14, 128)   # trained at 56 px
    torch.save(sd, tmp_path / "vit14.pt")
    net, _ = build_backbone("vit_nano_p4")
    report = load_backbone_weights(net, tmp_path / "vit14.pt")
    assert "resampled pos_embed from 14x14 to 8x8 patches" in report.line()
    torch.testing.assert_close(net.pos_embed.detach(), resample_abs_pos_embed(sd["pos_embed"], [8, 8]))
    sd["pos_embed"] = torch.randn(1, 1 + 14 * 14, 64)
    torch.save(sd, tmp_path / "narrow.pt")
    _refused(net, tmp_path / "narrow.pt", "the position embeddings differ in width")


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "fifo", "not_a_dict", "nan", "damaged"])
def test_bad_files_are_one_line(tmp_path, case):
    net, _ = build_backbone("small_cnn")
    path = tmp_path / "w.pt"
    fragment = {"missing": "no such file", "directory": "is a directory", "empty": "is empty",
                "fifo": "not a regular file", "not_a_dict": "not a state dict", "nan": "NaN or infinite",
                "damaged": "truncated or not a weights file"}[case]
    if case == "directory":
        path.mkdir()
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "not_a_dict":
        torch.save([torch.zeros(1)], path)
    elif case in ("nan", "damaged"):
        sd = {k: v.clone() for k, v in net.state_dict().items()}
        sd["features.0.weight"][0, 0, 0, 0] = float("nan")
        torch.save(sd, path)
        if case == "damaged":
            path.write_bytes(path.read_bytes()[:300])
    _refused(net, path, fragment)


def test_timm_vit_with_head_gives_timms_features(tmp_path):
    """A timm VisionTransformer's state dict (classifier head included) loads into the unison ViT of its shape,
    the head skipped, and both give the same class-token features."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(5)
    timm_vit = VisionTransformer(img_size=16, patch_size=2, embed_dim=128, depth=6, num_heads=4, num_classes=10)
    torch.save(timm_vit.state_dict(), tmp_path / "vit.pth")
    net, _ = build_backbone("vit_nano_p2")
    report = load_backbone_weights(net, tmp_path / "vit.pth")
    assert report.skipped == ["head.weight", "head.bias"]
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), timm_vit.eval().forward_head(timm_vit.forward_features(x),
                                                                                pre_logits=True))
