"""Batched, device-side view augmentation with per-sample randomness that ignores the world size.

`ViewAugmenter` turns a uint8 batch ``[B, 3, H, W]`` (on any device) into
`num_views` normalised float32 views. Every random parameter of view ``v`` of the
sample with dataset index ``i`` is drawn with `sample_uniform(seed, epoch, [i],
stream=v, ...)`, so the views of a sample are the same whatever the batch size,
the batch order, the other samples and the number of ranks (tested bit for bit).

Why hand-written: torchvision's v2 transforms draw *one* set of parameters per
batch call (vision#2929), and per-sample PIL pipelines in DataLoader workers are
slow and their RNG depends on the worker count. kornia draws per-sample
parameters but from a stateful generator (world-size dependent) and is not a
dependency. Each op below is a few tensor ops over the whole batch; there are no
per-sample Python loops.

Streamed data (`unison.data.stream`): step 1 is done on the CPU by the loader processes
(`unison.data.decode`: the same crop and flip draws, `crop_fractions`, applied to the image at
its original size with an antialiased resize, `unison.data.jpeg.resize_views`), and `finish` runs steps 2-7 on the crops.

Pipeline of one view (fixed order; torchvision randomises the jitter order):

1. random resized crop + horizontal flip (+ optional rotation) as ONE affine
   sampling grid (`F.affine_grid`'s computation, base grid cached) and one
   bilinear `grid_sample` to ``size x size``. Area fraction and log-aspect ratio
   are drawn 10 times like torchvision; the first attempt that fits is used,
   otherwise the whole image. Boxes are continuous (not rounded to pixels). No
   antialiasing: fine when the stored images are about the view size.
2. colour jitter, applied as a whole with probability ``jitter_p``: brightness
   (scale, clamp), contrast (blend with the image's mean grey, clamp), then
   saturation (blend with the grey image) and hue. Hue is a rotation of the
   chroma plane in YIQ space by ``2*pi*h`` turns (as NVIDIA DALI's hue op): it
   approximates torchvision's HSV hue shift without the HSV round trip.
3. random grayscale (ITU-R 601 weights, like torchvision).
   Saturation, hue and grayscale are linear in RGB, so they are folded into one
   per-sample 3x3 matrix: one batched matmul and ONE clamp, where torchvision
   clamps after each op (only pixels pushed out of [0, 1] by saturation differ;
   grayscale of a saturated/hue-rotated image equals grayscale of the input up to
   rounding, as both ops preserve luma).
4. gaussian blur with per-sample sigma, separable, reflect padding, radius
   ``ceil(3 * sigma_max)`` (on the CPU one depthwise convolution per sample, elsewhere weighted
   sums of shifted slices over the batch); disabled for every view when ``image_size <=
   blur_off_at_or_below`` (CIFAR recipes do not blur 32 px images).
5. solarisation (``x >= threshold -> 1 - x``).
6. optional additive gaussian noise (``noise_std``, [0, 1] units), clamped.
7. normalisation ``(x - mean) / std``.

Per-sample parameters are computed in float64 and then cast, and pixel ops are
elementwise or per-sample matmuls, so a view does not depend, bit for bit, on
where its sample sits in the batch (tests/data/test_data_augment.py). Ops run in place
on each view's fresh crop: new multi-MB buffers cost page faults on the CPU.

The presets and what each parameter means: `unison.data.presets` (`PRESETS`, re-exported here).

Example::

    aug = ViewAugmenter("simclr", image_size=32, mean=ds.mean, std=ds.std)
    idx = batch_indices.to(device)                     # dataset indices, int64 [B]
    v1, v2 = aug(images[idx], idx, epoch=epoch, seed=seed)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from unison.rng import sample_normal, sample_uniform

from .presets import PRESETS

__all__ = ["PRESETS", "ViewAugmenter", "default_local_size", "eval_transform", "view_sizes"]

_N_ATTEMPTS = 10
# Column layout of the per-view uniforms (fixed, so switching an op off leaves the others' draws unchanged).
_C_SCALE, _C_RATIO = 0, _N_ATTEMPTS
_C_X, _C_Y, _C_FLIP, _C_ROT = 2 * _N_ATTEMPTS, 2 * _N_ATTEMPTS + 1, 2 * _N_ATTEMPTS + 2, 2 * _N_ATTEMPTS + 3
_C_JIT = 2 * _N_ATTEMPTS + 4  # apply, brightness, contrast, saturation, hue
_C_GRAY, _C_BLUR, _C_SIGMA, _C_SOL = _C_JIT + 5, _C_JIT + 6, _C_JIT + 7, _C_JIT + 8
_N_COLS = _C_SOL + 1
_NOISE_STREAM = 1_000  # + view index; per-pixel draws live in their own stream

_GRAY_W64 = torch.tensor([0.2989, 0.587, 0.114], dtype=torch.float64)  # ITU-R 601 luma, as torchvision
_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], dtype=torch.float64)
_YIQ2RGB = torch.linalg.inv(_RGB2YIQ)


def default_local_size(image_size: int, multiple: int | None = None) -> int:
    """The side of the local crops when none is given: 3/7 of `image_size` (DINO's 96 px at 224), at least 8; for a
    patch-based backbone (`multiple`: its patch size) the nearest multiple of the patch, at least 8 px and one patch
    (12 px at 32 px with 4 px patches, 24 at 64 px with 8 px patches, 96 at 224 px with 16 px patches)."""
    if not multiple:
        return max(8, round(image_size * 3 / 7))
    return max(-(-8 // multiple) * multiple, round(image_size * 3 / 7 / multiple) * multiple)


def view_sizes(params: dict, image_size: int) -> list[int]:
    """The size of each view of a preset's parameters (`PRESETS[name]` with any overrides): ``n_global`` global
    views of `image_size`, then ``n_local`` local ones of ``local_size`` (default `default_local_size`)."""
    local = params["local_size"] or default_local_size(image_size)
    return [int(image_size)] * params["n_global"] + [int(local)] * params["n_local"]


def _per_view(value, n_views: int, name: str) -> list[float]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n_views:
            raise ValueError(f"{name} has {len(value)} entries, expected one per view ({n_views})")
        return [float(v) for v in value]
    return [float(value)] * n_views


def _col(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample [B] values as a [B, 1, 1, 1] broadcastable tensor."""
    return v.to(dtype)[:, None, None, None]


class ViewAugmenter:
    """Per-sample-random multi-view augmentation of uint8 batches; see the module docstring."""

    def __init__(self, preset: str, image_size: int, mean: Sequence[float], std: Sequence[float], **overrides):
        if preset not in PRESETS:
            raise ValueError(f"unknown augmentation preset {preset!r}; choose one of {sorted(PRESETS)}")
        unknown = set(overrides) - set(PRESETS[preset])
        if unknown:
            raise ValueError(f"unknown augmentation parameter(s) {sorted(unknown)}; valid: {sorted(PRESETS[preset])}")
        p = {**PRESETS[preset], **overrides}
        self.preset, self.image_size, self.params = preset, int(image_size), p
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.view_sizes: list[int] = view_sizes(p, self.image_size)
        self.num_views = len(self.view_sizes)
        if self.num_views == 0:
            raise ValueError("augmentation needs at least one view (n_global + n_local > 0)")
        blur_off = self.image_size <= p["blur_off_at_or_below"]
        self.blur_p = [0.0 if blur_off else b for b in _per_view(p["blur_p"], self.num_views, "blur_p")]
        self.solarize_p = _per_view(p["solarize_p"], self.num_views, "solarize_p")
        if not 0 <= p["hue"] <= 0.5:
            raise ValueError(f"hue must be in [0, 0.5], got {p['hue']}")
        self._norm: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grids: dict[tuple, torch.Tensor] = {}
        self._const: dict[torch.device, dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"ViewAugmenter({self.preset!r}, image_size={self.image_size}, view_sizes={self.view_sizes})"

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, indices: torch.Tensor, epoch: int, seed: int) -> list[torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images [B, 3, H, W], got {tuple(images.shape)}")
        if indices.shape != (images.shape[0],):
            raise ValueError(f"expected indices [{images.shape[0]}], got {tuple(indices.shape)}")
        x = images.float().mul_(1 / 255) if images.dtype == torch.uint8 else images.float()
        idx = indices.to(device=images.device, dtype=torch.int64)
        views = []
        for v, size in enumerate(self.view_sizes):
            u = self.uniforms(idx, epoch, seed, v)
            y = self._crop(x, u, size, v)
            views.append(self._appearance(y, u, idx, epoch, seed, v))
        return views

    @torch.no_grad()
    def finish(self, crops: Sequence[torch.Tensor], indices: torch.Tensor, epoch: int, seed: int) -> list[torch.Tensor]:
        """The views from crops made elsewhere: `crops[v]` is view v of every sample, uint8 [B, 3, s_v, s_v],
        cropped (and flipped) by `crop_fractions` of the same uniforms (the streaming loader's CPU crops).
        Runs steps 2-7 of the pipeline, with the same per-sample draws as `__call__`."""
        if len(crops) != self.num_views:
            raise ValueError(f"expected {self.num_views} crops per sample, got {len(crops)}")
        idx = indices.to(device=crops[0].device, dtype=torch.int64)
        views = []
        for v, c in enumerate(crops):
            if c.ndim != 4 or c.shape[1:] != (3, self.view_sizes[v], self.view_sizes[v]) or c.shape[0] != len(idx):
                raise ValueError(f"view {v}: expected crops [{len(idx)}, 3, {self.view_sizes[v]}, "
                                 f"{self.view_sizes[v]}], got {tuple(c.shape)}")
            y = c.float().mul_(1 / 255) if c.dtype == torch.uint8 else c.float()
            views.append(self._appearance(y, self.uniforms(idx, epoch, seed, v), idx, epoch, seed, v))
        return views

    @staticmethod
    def uniforms(indices: torch.Tensor, epoch: int, seed: int, view: int) -> torch.Tensor:
        """float64 [B, columns]: every random number view `view` of these samples uses (stream = view)."""
        return sample_uniform(seed, epoch, indices, stream=view, count=_N_COLS).double()

    def crop_scale(self, view: int) -> tuple[float, float]:
        p = self.params
        return tuple(p["crop_scale"] if view < p["n_global"] else p["local_crop_scale"])

    def crop_fractions(self, u: torch.Tensor, view: int, H, W) -> tuple[torch.Tensor, ...]:
        """(box width, box height, centre x, centre y) as fractions of W / H, and the flip flag, per sample.

        `H`, `W`: the image size, numbers or float64 [B, 1] (images of different sizes). The box is the
        first of 10 attempts that fits, as torchvision's RandomResizedCrop, else the whole image.
        """
        p = self.params
        lo, hi = self.crop_scale(view)
        area = lo + (hi - lo) * u[:, _C_SCALE : _C_SCALE + _N_ATTEMPTS]  # fraction of H*W
        lr_lo, lr_hi = math.log(p["crop_ratio"][0]), math.log(p["crop_ratio"][1])
        ratio = torch.exp(lr_lo + (lr_hi - lr_lo) * u[:, _C_RATIO : _C_RATIO + _N_ATTEMPTS])
        bw = torch.sqrt(area * ratio * (H / W))  # box width as a fraction of W
        bh = torch.sqrt(area / ratio * (W / H))
        ok = (bw <= 1) & (bh <= 1)
        first = ok.to(u.dtype).argmax(1, keepdim=True)  # first fitting attempt (argmax returns the first max)
        any_ok = ok.any(1)
        one = torch.ones((), dtype=u.dtype, device=u.device)
        bw = torch.where(any_ok, bw.gather(1, first)[:, 0], one)  # fallback: the whole image
        bh = torch.where(any_ok, bh.gather(1, first)[:, 0], one)
        cx = (1 - bw) * u[:, _C_X] + bw / 2  # box centre in [0, 1]
        cy = (1 - bh) * u[:, _C_Y] + bh / 2
        return bw, bh, cx, cy, u[:, _C_FLIP] < p["flip_p"]

    def _appearance(self, y: torch.Tensor, u: torch.Tensor, idx: torch.Tensor, epoch: int, seed: int,
                    v: int) -> torch.Tensor:
        """Steps 2-7 on the float crops of view v (in place where possible): colour ... normalisation."""
        p = self.params
        y = self._colour(y, u)
        if self.blur_p[v] > 0:
            y = self._blur(y, u, self.blur_p[v])
        if self.solarize_p[v] > 0:  # threshold above 1 = off for that sample
            t = torch.where(u[:, _C_SOL] < self.solarize_p[v], p["solarize_threshold"], 2.0)
            y = torch.where(y >= _col(t, y.dtype), 1 - y, y, out=y)
        if p["noise_std"] > 0:
            y = self._noise(y, idx, epoch, seed, v)
        return self._normalise(y)

    def crop_affine(self, u: torch.Tensor, view: int, H, W) -> torch.Tensor:
        """float64 [B, 2, 3]: view `view`'s normalised coordinates (``align_corners=False``) -> the image's: the crop
        box, flip and rotation of `crop_fractions`' draws (`H`, `W` as it takes them)."""
        p = self.params
        bw, bh, cx, cy, flip = self.crop_fractions(u, view, H, W)
        sx = torch.where(flip, -bw, bw)  # negative x scale = horizontal flip
        ang = torch.deg2rad(p["rotation"] * (2 * u[:, _C_ROT] - 1)) if p["rotation"] > 0 else torch.zeros_like(bw)
        cos, sin = torch.cos(ang), torch.sin(ang)
        # Output pixel (ox, oy) in [-1, 1] samples the input at (normalised, align_corners=False)
        #   gx = sx*(cos*ox - sin*oy) + (2cx - 1),  gy = bh*(sin*ox + cos*oy) + (2cy - 1)
        return torch.stack(
            (torch.stack((sx * cos, -sx * sin, 2 * cx - 1), 1), torch.stack((bh * sin, bh * cos, 2 * cy - 1), 1)), 1)

    def view_geometry(self, indices: torch.Tensor, epoch: int, seed: int, sizes: torch.Tensor) -> torch.Tensor:
        """float64 [B, V, 2, 3]: view v of sample b maps its normalised (x, y) (x right, y down, pixel centres at
        (2k + 1) / size - 1) to b's image in pixels as shown, by [b, v] @ (x, y, 1): its crop box, flip and rotation,
        from the draws of its pixels. `sizes`: int [B, 2], (H, W) of the images the views were cut from. What VICRegL
        locates feature-map cells by. Streamed views are cut from boxes rounded to whole pixels: within half a pixel."""
        idx, hw = indices.to(torch.int64), sizes.to(device=indices.device, dtype=torch.float64).reshape(-1, 2)
        to_pixels = hw.flip(1)[:, :, None] / 2   # [B, 2, 1]: x = (g + 1) * W / 2, y = (g + 1) * H / 2
        out = []
        for v in range(self.num_views):
            theta = self.crop_affine(self.uniforms(idx, epoch, seed, v), v, hw[:, :1], hw[:, 1:])
            theta[:, :, 2] += 1
            out.append(theta * to_pixels)
        return torch.stack(out, 1)

    # -- ops ---------------------------------------------------------------------------------------
    def _crop(self, x: torch.Tensor, u: torch.Tensor, size: int, view: int) -> torch.Tensor:
        B, _, H, W = x.shape
        theta = self.crop_affine(u, view, H, W).to(x.dtype)
        # = F.affine_grid(theta, ...), with the base grid cached and one broadcast matmul (less work than affine_grid).
        grid = torch.matmul(self._base_grid(size, x.device, x.dtype), theta.transpose(1, 2)).view(B, size, size, 2)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def _colour(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Jitter (brightness, contrast, then saturation and hue) and random grayscale."""
        p = self.params
        B = x.shape[0]
        on = u[:, _C_JIT] < p["jitter_p"]
        factor = lambda k, s: torch.where(on, 1 + s * (2 * u[:, _C_JIT + k] - 1), 1.0)  # noqa: E731
        y = x
        # In-place on the crop's fresh output: new multi-MB buffers cost page faults on the CPU.
        if p["jitter_p"] > 0 and p["brightness"] > 0:
            y.mul_(_col(factor(1, p["brightness"]), y.dtype)).clamp_(0, 1)
        if p["jitter_p"] > 0 and p["contrast"] > 0:
            f = factor(2, p["contrast"])
            m = y.reshape(B, 3, -1).mean(-1).double() @ self._consts(u.device)["gray_w"]  # mean grey level
            y.mul_(_col(f, y.dtype)).add_(_col((1 - f) * m, y.dtype)).clamp_(0, 1)
        # Saturation, hue and grayscale are linear in RGB: fold them into one per-sample 3x3 matrix
        # (one bmm and one clamp instead of a clamp after each op). Samples without any of them get
        # exactly the identity, so they pass through bit for bit.
        c = self._consts(u.device)
        eye, gray_mat = c["eye"].expand(B, 3, 3), c["gray_mat"]
        mat = None
        if p["jitter_p"] > 0 and p["saturation"] > 0:
            f = factor(3, p["saturation"])[:, None, None]
            mat = f * eye + (1 - f) * gray_mat  # blend with the grey image
        if p["jitter_p"] > 0 and p["hue"] > 0:
            ang = 2 * math.pi * p["hue"] * (2 * u[:, _C_JIT + 4] - 1)
            rot = torch.zeros(B, 3, 3, dtype=torch.float64, device=u.device)
            rot[:, 0, 0] = 1
            rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = ang.cos(), -ang.sin(), ang.sin(), ang.cos()
            hue = c["yiq2rgb"] @ rot @ c["rgb2yiq"]  # rotate chroma, keep luma
            hue = torch.where(on[:, None, None], hue, eye)  # the YIQ round trip is not exact at angle 0
            mat = hue if mat is None else hue @ mat
        if p["grayscale_p"] > 0:
            g = torch.where((u[:, _C_GRAY] < p["grayscale_p"])[:, None, None], gray_mat, eye)
            mat = g if mat is None else g @ mat
        if mat is not None:
            y = torch.bmm(mat.to(y.dtype), y.reshape(B, 3, -1)).view_as(y).clamp_(0, 1)
        return y

    def _blur(self, x: torch.Tensor, u: torch.Tensor, prob: float) -> torch.Tensor:
        lo, hi = self.params["blur_sigma"]
        H, W = x.shape[-2:]
        r = min(math.ceil(3 * hi), H - 1, W - 1)  # reflect padding needs r < size
        if r < 1:
            return x
        # Only the samples drawn for blurring are blurred (the others would get the delta kernel, an exact
        # identity): about half the work at blur_p 0.5, and every sample's result is unchanged.
        rows = (u[:, _C_BLUR] < prob).nonzero()[:, 0]
        if rows.numel() == 0:
            return x
        every = rows.numel() == x.shape[0]
        su = u if every else u[rows]
        sigma = lo + (hi - lo) * su[:, _C_SIGMA]
        k = torch.arange(-r, r + 1, device=u.device, dtype=torch.float64)
        w = torch.exp(-(k[None] ** 2) / (2 * sigma[:, None] ** 2))
        w = (w / w.sum(1, keepdim=True)).to(x.dtype)
        if x.device.type == "cpu":  # one depthwise convolution per sample, in place: less work than the sums below
            return _blur_each(x, rows.tolist(), w, r)
        sub = x if every else x[rows]
        w = w[:, :, None, None, None]  # [B, taps, 1, 1, 1]
        # Separable blur as weighted sums of shifted slices: per-sample kernels, batch-independent results.
        xp = F.pad(sub, (r, r, 0, 0), mode="reflect")
        y = xp[..., :, 0:W] * w[:, 0]
        for i in range(1, 2 * r + 1):
            y.addcmul_(xp[..., :, i : i + W], w[:, i])
        yp = F.pad(y, (0, 0, r, r), mode="reflect")
        out = yp[..., 0:H, :] * w[:, 0]
        for i in range(1, 2 * r + 1):
            out.addcmul_(yp[..., i : i + H, :], w[:, i])
        if every:
            return out
        x[rows] = out
        return x

    def _noise(self, x: torch.Tensor, idx: torch.Tensor, epoch: int, seed: int, v: int) -> torch.Tensor:
        B, C, H, W = x.shape
        z = sample_normal(seed, epoch, idx, stream=_NOISE_STREAM + v, count=C * H * W).view(B, C, H, W)
        return x.add_(z.mul_(self.params["noise_std"]).to(x.dtype)).clamp_(0, 1)

    def _consts(self, device: torch.device) -> dict[str, torch.Tensor]:
        # Cached per device: a host->device copy per call would stall the CUDA stream.
        if device not in self._const:
            gray_w = _GRAY_W64.to(device)
            self._const[device] = dict(
                gray_w=gray_w,
                gray_mat=torch.ones(3, 1, dtype=torch.float64, device=device) * gray_w[None],  # rows = luma weights
                eye=torch.eye(3, dtype=torch.float64, device=device),
                rgb2yiq=_RGB2YIQ.to(device),
                yiq2rgb=_YIQ2RGB.to(device),
            )
        return self._const[device]

    def _base_grid(self, size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[size*size, 3] rows (ox, oy, 1) of output pixel centres in [-1, 1] (align_corners=False)."""
        key = (size, device, dtype)
        if key not in self._grids:
            o = (torch.arange(size, device=device, dtype=torch.float64) * 2 + 1) / size - 1
            oy, ox = torch.meshgrid(o, o, indexing="ij")
            self._grids[key] = torch.stack((ox, oy, torch.ones_like(ox)), -1).reshape(-1, 3).to(dtype)
        return self._grids[key]

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        scale, bias = _norm_tensors(self._norm, x.device, self.mean, self.std)
        return x.mul_(scale).add_(bias)  # (x - mean) / std, in place


def _blur_each(x: torch.Tensor, rows: list[int], w: torch.Tensor, r: int) -> torch.Tensor:
    """Separable blur of samples `rows` of x [B, C, H, W] in place, row k with taps w[k] [2r+1], reflect padding.
    Sample by sample, every convolution has the same shapes whatever the batch: a view does not depend on it."""
    C = x.shape[1]
    taps = w[:, None, None, None, :].expand(-1, C, 1, 1, -1).contiguous()  # [n, C, 1, 1, 2r+1]: one kernel each
    for k, b in enumerate(rows):
        xp = F.pad(x[b : b + 1], (r, r, r, r), mode="reflect")
        y = F.conv2d(xp, taps[k], groups=C)
        x[b] = F.conv2d(y, taps[k].view(C, 1, -1, 1), groups=C)[0]
    return x


_EVAL_NORM: dict = {}


def _norm_tensors(cache: dict, device: torch.device, mean, std) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/std, -mean/std) as [1, 3, 1, 1] float32 on `device`, cached per (device, mean, std)."""
    key = (device, tuple(mean), tuple(std))
    if key not in cache:
        m = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
        s = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
        cache[key] = ((1 / s).float().to(device), (-m / s).float().to(device))
    return cache[key]


@torch.no_grad()
def eval_transform(images: torch.Tensor, image_size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> normalised float32 [B, 3, image_size, image_size].

    Resizes (bilinear, antialiased) only when the images are not already ``image_size`` square.
    """
    x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    if x.shape[-2:] != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    scale, bias = _norm_tensors(_EVAL_NORM, x.device, tuple(mean), tuple(std))
    return torch.addcmul(bias, x, scale)
