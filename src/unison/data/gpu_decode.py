"""``--decode gpu``: loader processes only read bytes; the training process decodes and crops on the GPU.

* `BytesReader` (in the loader workers): the encoded bytes of each sample of a job, checked by
  parsing the image header (unreadable files follow ``on_corrupt`` as on the CPU path: the next
  readable sample in catalog order stands in, with the original sample's random draws).
* `GpuCropper` (in the training process): ``torchvision.io.decode_jpeg(list, device=...)``
  decodes the job's JPEGs in one batched call (nvJPEG on CUDA); other formats, and JPEGs the
  batched decoder refuses (CMYK, ...), are decoded on the CPU and moved. Each view's box is
  drawn on the size as shown (EXIF orientation applied: ``apply_exif_orientation`` on the GPU,
  `unison.data.files.upright` on the CPU, as every other path) by `ViewAugmenter.crop_fractions` (the CPU path's draws) and
  cropped and resized in one `torchvision.ops.roi_align` per sample and view, with adaptive
  sampling (about ceil(box / size)^2 bilinear samples averaged per output pixel: an antialiased
  resize), then flipped and rounded to uint8; `ViewAugmenter.finish` does the rest, batched.

The views are a function of (seed, epoch, sample index) as on the CPU path, but not the same
pixels (another JPEG decoder, no DCT scaling, another resize filter). The same code runs with
``device="cpu"`` (how the tests check it on machines without a GPU); `TrainConfig.validate`
refuses ``--decode gpu`` without CUDA.

Example::

    cropper = GpuCropper(augmenter, seed=0, device=torch.device("cuda"))
    crops = cropper(job_output, indices)          # list of uint8 [b, 3, s_v, s_v] on the GPU
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from .augment import ViewAugmenter
from .decode import CropDecoder, to_rgb
from .files import open_image, orientation, upright, upright_size
from .samples import Catalog

__all__ = ["BytesReader", "GpuCropper"]


class BytesReader(CropDecoder):
    """A loader job's encoded bytes (header-checked), with the CPU path's handling of unreadable files."""

    def __init__(self, catalog: Catalog, seed: int, on_corrupt: str, positions: np.ndarray | None = None):
        super().__init__(catalog, None, seed, on_corrupt, positions)  # type: ignore[arg-type]

    def __call__(self, job: tuple[int, list[int]]) -> dict[str, Any]:
        epoch, indices = job
        data: list[torch.Tensor] = []
        sizes: list[tuple[int, int]] = []
        skipped: list[tuple[str, str]] = []
        for i in indices:
            im, _, found = self._readable(i, skipped, start=0)
            if im is None:
                return {"epoch": epoch, "indices": torch.as_tensor(indices), "data": [], "skipped": [],
                        "error": skipped[-1]}
            data.append(torch.frombuffer(bytearray(found), dtype=torch.uint8))
            w, h = upright_size(im)   # as the GPU decodes it (EXIF orientation applied)
            sizes.append((h, w))
        return {"epoch": epoch, "indices": torch.as_tensor(indices, dtype=torch.int64), "data": data,
                "sizes": torch.tensor(sizes, dtype=torch.int64), "skipped": skipped, "error": None}


class GpuCropper:
    """Decode a job's bytes on `device` and cut every view's crops there (see the module docstring)."""

    def __init__(self, augment: ViewAugmenter, seed: int, device: torch.device):
        self.augment, self.seed, self.device = augment, seed, device

    def decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """uint8 [3, H, W] RGB images on the device."""
        from torchvision.io import ImageReadMode, decode_jpeg

        out: list[torch.Tensor | None] = [None] * len(data)
        jpeg = [k for k, d in enumerate(data) if len(d) > 2 and int(d[0]) == 0xFF and int(d[1]) == 0xD8]
        if jpeg:
            try:
                with warnings.catch_warnings():  # torchvision >= 0.29: deprecation notice on every call
                    warnings.simplefilter("ignore", DeprecationWarning)
                    decoded = decode_jpeg([data[k] for k in jpeg], mode=ImageReadMode.RGB, device=self.device,
                                          apply_exif_orientation=True)
                for k, img in zip(jpeg, decoded):
                    out[k] = img
            except RuntimeError:  # one JPEG the batched decoder refuses: decode those one by one below
                pass
        for k, img in enumerate(out):
            if img is None:  # PNG, WebP, CMYK JPEG, ...: PIL on the CPU
                im = open_image(data[k].numpy().tobytes())
                rgb = np.asarray(upright(to_rgb(im), orientation(im)), dtype=np.uint8)
                out[k] = torch.from_numpy(rgb.copy()).permute(2, 0, 1).to(self.device)
        return out  # type: ignore[return-value]

    def __call__(self, job: dict[str, Any], indices: torch.Tensor) -> list[torch.Tensor]:
        from torchvision.ops import roi_align

        images = self.decode(job["data"])
        epoch = int(job["epoch"])
        job["sizes"] = torch.tensor([list(im.shape[1:]) for im in images], dtype=torch.int64)   # as cut: (H, W)
        H = torch.tensor([[im.shape[1]] for im in images], dtype=torch.float64, device=self.device)
        W = torch.tensor([[im.shape[2]] for im in images], dtype=torch.float64, device=self.device)
        crops = []
        for v, size in enumerate(self.augment.view_sizes):
            u = self.augment.uniforms(indices, epoch, self.seed, v)
            bw, bh, cx, cy, flip = self.augment.crop_fractions(u, v, H, W)
            boxes = torch.stack(((cx - bw / 2) * W[:, 0], (cy - bh / 2) * H[:, 0],
                                 (cx + bw / 2) * W[:, 0], (cy + bh / 2) * H[:, 0]), 1).float()
            out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=self.device)
            for k, im in enumerate(images):
                # aligned=True: box coordinates are pixel edges, as PIL's resize box on the CPU path.
                y = roi_align(im[None].float(), [boxes[k:k + 1]], output_size=size, spatial_scale=1.0,
                              sampling_ratio=-1, aligned=True)[0]
                out[k] = y.round_().clamp_(0, 255).to(torch.uint8)
            flip_rows = flip.nonzero()[:, 0]
            if flip_rows.numel():
                out[flip_rows] = out[flip_rows].flip(-1)
            crops.append(out)
        return crops
