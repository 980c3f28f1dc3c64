"""ViewAugmenter: per-sample randomness, world-size invariance, presets, eval transform."""

from __future__ import annotations

import pytest
import torch

from unison.data import PRESETS, ViewAugmenter, eval_transform

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)


# (preset, image size, overrides): 64 px so that blur (off at <= 32 px) and BYOL's solarisation run
# too; digits also with pixel noise and rotation.
CASES = [
    ("simclr", 32, {}),
    ("simclr", 64, {}),
    ("byol", 64, {}),
    ("multicrop", 32, {}),
    ("digits", 16, {}),
    ("digits", 16, {"noise_std": 0.05, "rotation": 30.0}),
]


def _images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Smooth-ish colourful images: a random low-res pattern upsampled, so crops and blur matter.
    small = torch.randint(0, 256, (n, 3, 4, 4), generator=g).float()
    return torch.nn.functional.interpolate(small, size=(size, size), mode="bilinear").round().to(torch.uint8)


@pytest.mark.parametrize("preset, size, overrides", CASES)
def test_world_size_invariance_bitwise(preset, size, overrides):
    aug = ViewAugmenter(preset, size, MEAN, STD, **overrides)
    images, idx = _images(8, size), torch.tensor([5, 17, 2, 40, 41, 9, 1000, 3])
    full = aug(images, idx, epoch=3, seed=11)
    halves = [aug(images[s], idx[s], epoch=3, seed=11) for s in (slice(0, 4), slice(4, 8))]
    perm = torch.tensor([6, 1, 7, 0, 3, 5, 2, 4])
    permuted = aug(images[perm], idx[perm], epoch=3, seed=11)
    single = aug(images[5:6], idx[5:6], epoch=3, seed=11)
    for v in range(aug.num_views):
        assert torch.equal(torch.cat([halves[0][v], halves[1][v]]), full[v]), f"view {v}: halves differ"
        assert torch.equal(permuted[v], full[v][perm]), f"view {v}: batch order matters"
        assert torch.equal(single[v][0], full[v][5]), f"view {v}: batch size matters"


@pytest.mark.parametrize("preset, size, overrides", CASES)
def test_presets_views_sizes_and_normalisation(preset, size, overrides):
    aug = ViewAugmenter(preset, size, MEAN, STD, **overrides)
    views = aug(_images(16, size), torch.arange(16), epoch=0, seed=0)
    assert len(views) == aug.num_views == len(aug.view_sizes)
    for v, s in zip(views, aug.view_sizes):
        assert v.shape == (16, 3, s, s) and v.dtype == torch.float32 and bool(v.isfinite().all())
        raw = v * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
        assert float(raw.min()) > -1e-5 and float(raw.max()) < 1 + 1e-5  # normalised [0, 1] pixels


def test_preset_view_layouts():
    assert ViewAugmenter("simclr", 32, MEAN, STD).view_sizes == [32, 32]
    assert ViewAugmenter("multicrop", 32, MEAN, STD).view_sizes == [32, 32, 14, 14, 14, 14]
    assert ViewAugmenter("multicrop", 224, MEAN, STD).view_sizes == [224, 224] + [96] * 4
    assert ViewAugmenter("multicrop", 16, MEAN, STD).view_sizes[-1] == 8  # minimum local size
    # CIFAR recipes: no blur at <= 32 px; BYOL's asymmetric blur above that.
    assert ViewAugmenter("simclr", 32, MEAN, STD).blur_p == [0.0, 0.0]
    assert ViewAugmenter("byol", 64, MEAN, STD).blur_p == [1.0, 0.1]
    assert ViewAugmenter("byol", 64, MEAN, STD).solarize_p == [0.0, 0.2]
    assert PRESETS["digits"]["flip_p"] == 0.0
    aug = ViewAugmenter("simclr", 32, MEAN, STD, n_global=3, blur_off_at_or_below=0)
    assert aug.num_views == 3 and aug.blur_p == [0.5] * 3
    with pytest.raises(ValueError, match="unknown augmentation preset"):
        ViewAugmenter("moco", 32, MEAN, STD)
    with pytest.raises(ValueError, match="unknown augmentation parameter"):
        ViewAugmenter("simclr", 32, MEAN, STD, blurr_p=0.1)
    with pytest.raises(ValueError, match="one per view"):
        ViewAugmenter("simclr", 32, MEAN, STD, solarize_p=(0.1, 0.2, 0.3))


@pytest.mark.parametrize("preset, size, overrides", CASES)
def test_per_sample_parameters_differ_within_a_batch(preset, size, overrides):
    aug = ViewAugmenter(preset, size, MEAN, STD, **overrides)
    images = _images(1, size).expand(6, -1, -1, -1).contiguous()  # six copies of one image
    views = aug(images, torch.arange(100, 106), epoch=0, seed=0)
    for v in views:
        flat = v.flatten(1)
        dist = torch.cdist(flat, flat)
        assert float(dist[~torch.eye(6, dtype=torch.bool)].min()) > 1e-3, "two samples got the same view"
    # Same index again = same views; another epoch or seed = other views.
    again = aug(images, torch.arange(100, 106), epoch=0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(views, again))
    assert not torch.equal(aug(images, torch.arange(100, 106), epoch=1, seed=0)[0], views[0])
    assert not torch.equal(aug(images, torch.arange(100, 106), epoch=0, seed=1)[0], views[0])


def test_crop_boxes_and_flips_differ_per_sample():
    # Identity colour pipeline: each view pixel is then an interpolated input coordinate.
    aug = ViewAugmenter("simclr", 32, (0, 0, 0), (1, 1, 1), jitter_p=0, grayscale_p=0)
    ramp = torch.arange(32, dtype=torch.float32).mul(8).to(torch.uint8)
    x_coord = ramp.view(1, 1, 1, 32).expand(64, 3, 32, 32).contiguous()  # value = 8 * column
    (view,) = aug(x_coord, torch.arange(64), epoch=0, seed=0)[:1]
    left, right = view[:, 0, 16, 0] * 255 / 8, view[:, 0, 16, -1] * 255 / 8  # input column at the view's edges
    width = (right - left).abs()
    assert float(width.std()) > 2, "crop widths do not vary"
    assert float(((left + right) / 2).std()) > 1, "crop positions do not vary"
    flipped = right < left
    assert 10 < int(flipped.sum()) < 54, "flip is not per sample with p = 0.5"


def test_digits_preset_never_flips():
    aug = ViewAugmenter("digits", 16, (0, 0, 0), (1, 1, 1), jitter_p=0, noise_std=0, rotation=0)
    ramp = torch.arange(16, dtype=torch.float32).mul(16).to(torch.uint8)
    img = ramp.view(1, 1, 1, 16).expand(64, 3, 16, 16).contiguous()
    for view in aug(img, torch.arange(64), epoch=0, seed=0):
        assert bool((view[:, 0, 8, -1] > view[:, 0, 8, 0]).all())


def test_colour_ops_are_applied_per_sample():
    aug = ViewAugmenter("simclr", 32, (0, 0, 0), (1, 1, 1), crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0)
    img = _images(1, 32).expand(400, -1, -1, -1).contiguous()
    (v,) = aug(img, torch.arange(400), epoch=0, seed=0)[:1]
    base = img[0].float() / 255
    unchanged = (v - base).abs().flatten(1).amax(1) < 1e-6
    gray = (v[:, 0] - v[:, 1]).abs().flatten(1).amax(1) < 1e-6
    # P(no jitter and no grayscale) = 0.2 * 0.8 = 0.16; P(grayscale) = 0.2.
    assert 0.08 < float(unchanged.float().mean()) < 0.25
    assert 0.12 < float(gray.float().mean()) < 0.28


def test_eval_transform():
    img = _images(4, 16)
    out = eval_transform(img, 16, MEAN, STD)
    expect = (img.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out, expect, atol=1e-6)
    assert eval_transform(img, 32, MEAN, STD).shape == (4, 3, 32, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    aug = ViewAugmenter("byol", 64, MEAN, STD)
    images, idx = _images(8, 64), torch.arange(8)
    cpu = aug(images, idx, epoch=1, seed=2)
    gpu = aug(images.cuda(), idx.cuda(), epoch=1, seed=2)
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=0)
