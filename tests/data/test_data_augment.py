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


def _ramp(height: int, width: int) -> torch.Tensor:
    """float [1, 3, H, W]: red = x / W and green = y / H at each pixel's centre, so a view's pixels say where in
    the image they were sampled."""
    ys, xs = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    return torch.stack([xs / width, ys / height, torch.zeros_like(xs)])[None]


def _view_points(size: int) -> torch.Tensor:
    """[size * size, 3]: (x, y, 1) of a view's pixel centres in its normalised coordinates, raster order."""
    o = (torch.arange(size, dtype=torch.float64) * 2 + 1) / size - 1
    oy, ox = torch.meshgrid(o, o, indexing="ij")
    return torch.stack([ox, oy, torch.ones_like(ox)], -1).reshape(-1, 3)


@pytest.mark.parametrize("preset, overrides", [("simclr", {}), ("digits", {"rotation": 30.0}), ("multicrop", {})])
def test_view_geometry_says_where_each_views_pixels_come_from(preset, overrides):
    """A view's pixels sampled from a coordinate ramp read the image positions `view_geometry` puts them at: crop
    box, flip and rotation, for every view (global and local) of samples in a non-square image."""
    colour_off = dict(jitter_p=0.0, grayscale_p=0.0, blur_p=0.0, solarize_p=0.0)
    aug = ViewAugmenter(preset, 16, (0.0,) * 3, (1.0,) * 3, **colour_off, **overrides)
    height, width, n = 24, 40, 8
    idx = torch.tensor([3, 9, 27, 81, 243, 729, 2187, 6561])
    views = aug(_ramp(height, width).expand(n, -1, -1, -1), idx, epoch=2, seed=5)
    geometry = aug.view_geometry(idx, 2, 5, torch.tensor([[height, width]]).expand(n, 2))
    assert geometry.shape == (n, aug.num_views, 2, 3) and geometry.dtype == torch.float64
    flipped = 0
    for v, view in enumerate(views):
        where = torch.einsum("bij,pj->bpi", geometry[:, v], _view_points(view.shape[-1]))   # [n, pixels, 2]
        inside = ((where[..., 0] > 0.5) & (where[..., 0] < width - 0.5) & (where[..., 1] > 0.5)
                  & (where[..., 1] < height - 0.5))     # away from the border, where sampling clamps
        seen = view[:, :2].flatten(2).transpose(1, 2).double()                              # [n, pixels, 2]
        expected = where / torch.tensor([width, height], dtype=torch.float64)
        assert inside.float().mean() > 0.8
        torch.testing.assert_close(seen[inside], expected[inside], rtol=0, atol=1e-5)
        flipped += int((geometry[:, v, 0, 0] < 0).sum())
    assert preset == "digits" or flipped > 0   # the flips were part of it (digits: no flip, rotations)


def test_view_geometry_depends_on_the_sample_and_its_image_size_only():
    aug = ViewAugmenter("simclr", 16, MEAN, STD)
    idx = torch.tensor([4, 8, 15, 16])
    sizes = torch.tensor([[32, 32], [20, 50], [32, 32], [64, 16]])
    whole = aug.view_geometry(idx, 1, 3, sizes)
    for k in range(4):
        torch.testing.assert_close(aug.view_geometry(idx[k:k + 1], 1, 3, sizes[k:k + 1]), whole[k:k + 1], rtol=0, atol=0)
    scaled = aug.view_geometry(idx, 1, 3, sizes * 2)   # twice the pixels: the same crops, in twice the units
    torch.testing.assert_close(scaled, whole * 2, rtol=1e-12, atol=1e-12)
