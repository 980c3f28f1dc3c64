"""Generated image data sets on disk: for tests, `unison bench data` and the memory benchmark.

`write_image_folder(root, n, ...)` writes an ImageFolder of smooth random colour images
(a random low-resolution field upsampled: JPEG sizes like photographs', not like noise) of
random sizes, modes and formats: RGB, grayscale and CMYK JPEGs; palette, RGBA and 16-bit
grey PNGs; and BMP / WebP. Everything is a function of ``seed``. `write_file_list` and
`write_shards` pack the same samples, in the same order, as a file list and as WebDataset
tar shards (written with ``webdataset.TarWriter`` when installed, else ``tarfile``).

Example::

    files = write_image_folder(tmp / "train", 300, classes=3, sizes=(24, 96))
    write_shards(tmp / "train", files, tmp / "shards", per_shard=100)
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

__all__ = ["MODES", "write_file_list", "write_image_folder", "write_shards"]

# (PIL mode, format, extension) cycled over the samples.
MODES = (("RGB", "JPEG", ".jpg"), ("L", "JPEG", ".jpg"), ("RGB", "PNG", ".png"), ("P", "PNG", ".png"),
         ("RGBA", "PNG", ".png"), ("CMYK", "JPEG", ".jpg"), ("RGB", "JPEG", ".jpeg"), ("I;16", "PNG", ".png"),
         ("RGB", "BMP", ".bmp"), ("RGB", "WEBP", ".webp"))


def smooth_image(rng: np.random.Generator, width: int, height: int):
    """A smooth random RGB PIL image (a 6x6 colour field, bicubically upsampled, plus mild noise)."""
    from PIL import Image

    field = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((width, height),
                                                                                     Image.Resampling.BICUBIC)
    arr = np.asarray(field, dtype=np.int16) + rng.integers(-8, 9, (height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def encode(im, mode: str, fmt: str) -> bytes:
    if mode == "I;16":
        arr = np.asarray(im.convert("L"), dtype=np.uint16) * 257
        im = _from_uint16(arr)
    elif mode == "P":
        im = im.quantize(64)
    else:
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _from_uint16(arr: np.ndarray):
    from PIL import Image

    return Image.frombytes("I;16", (arr.shape[1], arr.shape[0]), arr.astype("<u2").tobytes())


def write_image_folder(root: str | Path, n: int, *, classes: int = 3, sizes: tuple[int, int] = (24, 96),
                       seed: int = 0, modes: tuple = MODES) -> list[str]:
    """n images in ``root/class_k/`` (sizes uniform in `sizes`, both sides independently); returns the
    relative paths in ImageFolder order (by class, then name)."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    files = []
    for i in range(n):
        mode, fmt, ext = modes[i % len(modes)]
        w, h = (int(x) for x in rng.integers(sizes[0], sizes[1] + 1, 2))
        rel = f"class_{i % classes}/img_{i:06d}{ext}"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode(smooth_image(rng, w, h), mode, fmt))
        files.append(rel)
    return sorted(files, key=lambda r: (r.split("/")[0], r))


def write_file_list(root: str | Path, files: list[str], out: str | Path, labels: bool = True) -> Path:
    """A file list of `files` (relative to `root`), with the class folder as the label when `labels`."""
    root, out = Path(root).resolve(), Path(out)
    lines = [f"{root / f}\t{f.split('/')[0]}" if labels else str(root / f) for f in files]
    out.write_text("\n".join(lines) + "\n")
    return out


def write_shards(root: str | Path, files: list[str], out_dir: str | Path, per_shard: int = 100,
                 labels: bool = True) -> list[Path]:
    """`files` (relative to `root`) as WebDataset shards ``out_dir/shard-00000.tar``, ... in order; the label
    is the index of the class folder among the sorted class names (a ``.cls`` member)."""
    root, out_dir = Path(root), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    class_names = sorted({f.split("/")[0] for f in files})
    paths = []
    for s in range(0, len(files), per_shard):
        path = out_dir / f"shard-{s // per_shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for f in files[s:s + per_shard]:
                key = f.rsplit(".", 1)[0]
                members = [(f"{key}.{f.rsplit('.', 1)[1]}", (root / f).read_bytes())]
                if labels:
                    members.append((f"{key}.cls", str(class_names.index(f.split("/")[0])).encode()))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths
