"""Datasets (digits, ImageFolder, CIFAR-10) and counter-based randomness."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unison import rng as R
from unison.data import builtin, epoch_permutation, global_batches, load_dataset, memory, sample_uniform
from unison.data import datasets as D
from unison.errors import DataError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CIFAR = Path(__file__).resolve().parents[2].parent / "shared/data/cifar10"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Never touch ~/.cache in tests; each test gets an empty cache folder.
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("UNISON_NO_CACHE", raising=False)


# -- random -------------------------------------------------------------------------------------------
def _reference_hash(key: int, index: int, col: int) -> int:
    """Pure-Python uint64 version of R.hash64 (checks wrapping multiply and logical shifts)."""
    m = (1 << 64) - 1
    h = R._mix_int((index * R._GOLDEN + key) & m)
    return R._mix_int(R._mix_int(h ^ ((col * R._M2 + R._GOLDEN) & m)))


def test_hash_matches_uint64_reference():
    idx = torch.tensor([0, 1, 7, 2**31 + 5, 2**40 + 3, 2**62 + 11])
    key = R.combine_key(123, 4, 5)
    h = R.hash64(key, idx, 3)
    for a, i in enumerate(idx.tolist()):
        for c in range(3):
            assert int(h[a, c]) & ((1 << 64) - 1) == _reference_hash(key, i, c)


def test_sample_uniform_range_determinism_and_uniformity():
    idx = torch.arange(50_000)
    u = sample_uniform(0, 0, idx, stream=0, count=4)
    assert u.dtype == torch.float32 and u.shape == (50_000, 4)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, sample_uniform(0, 0, idx, stream=0, count=4))
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.std()) - (1 / 12) ** 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.01
    # Columns, streams, epochs and seeds all give different numbers.
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.02
    for other in (
        sample_uniform(0, 0, idx, stream=1, count=4),
        sample_uniform(0, 1, idx, stream=0, count=4),
        sample_uniform(1, 0, idx, stream=0, count=4),
    ):
        assert float((other == u).float().mean()) < 0.001


def test_sample_uniform_is_per_sample():
    idx = torch.tensor([11, 3, 500, 3])
    u = sample_uniform(7, 2, idx, stream=5, count=6)
    assert torch.equal(u[1], u[3])  # same index, same numbers
    for row, i in enumerate(idx.tolist()):
        assert torch.equal(u[row], sample_uniform(7, 2, torch.tensor([i]), stream=5, count=6)[0])
    # A prefix of the columns does not depend on how many columns are drawn.
    assert torch.equal(u[:, :2], sample_uniform(7, 2, idx, stream=5, count=2))


def test_sample_normal_is_standard_and_per_sample():
    idx = torch.arange(1000)
    z = R.sample_normal(3, 1, idx, stream=9, count=301)
    assert z.shape == (1000, 301) and z.dtype == torch.float32 and bool(z.isfinite().all())
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z.abs() < 1).float().mean()) - 0.6827) < 0.01
    assert torch.equal(R.sample_normal(3, 1, idx[[42]], stream=9, count=301)[0], z[42])
    assert not torch.equal(R.sample_normal(3, 2, idx, stream=9, count=301), z)


def test_epoch_permutation_and_global_batches():
    p0 = epoch_permutation(1000, epoch=0, seed=0)
    assert p0.dtype == torch.int64 and torch.equal(p0.sort().values, torch.arange(1000))
    assert torch.equal(p0, epoch_permutation(1000, epoch=0, seed=0))
    assert not torch.equal(p0, epoch_permutation(1000, epoch=1, seed=0))
    assert not torch.equal(p0, epoch_permutation(1000, epoch=0, seed=1))
    batches = global_batches(1000, 128, epoch=3, seed=0)
    assert len(batches) == 7 and all(b.shape == (128,) for b in batches)  # drop_last
    flat = torch.cat(batches)
    assert flat.unique().numel() == 896
    assert torch.equal(flat, epoch_permutation(1000, 3, 0)[:896])
    with pytest.raises(ValueError, match="larger than the dataset"):
        global_batches(100, 128, epoch=0, seed=0)


# -- digits -------------------------------------------------------------------------------------------
def test_digits_shapes_split_and_stats():
    train, val = load_dataset("digits", "train"), load_dataset("digits", "val")
    assert train.images.shape == (1438, 3, 16, 16) and val.images.shape == (359, 3, 16, 16)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.images.is_contiguous() and len(train) == 1438
    assert train.classes == [str(i) for i in range(10)]
    assert int(train.images.max()) == 255 and torch.equal(train.images[:, 0], train.images[:, 2])
    assert train.mean == val.mean and 0.2 < train.mean[0] < 0.4 and 0.2 < train.std[0] < 0.45
    # Stratified: every class has ~20 % of its images in val.
    _, all_labels = builtin.digits_all()
    for c in range(10):
        n_c, n_val = int((all_labels == c).sum()), int((val.labels == c).sum())
        assert abs(n_val - 0.2 * n_c) <= 1
    # Fixed regardless of seed.
    assert torch.equal(load_dataset("digits", "val", seed=5).images, val.images)


def test_digits_are_scikit_learns_read_without_its_reader(monkeypatch):
    """The embedded digits are read from scikit-learn's file, not through `sklearn.datasets.load_digits` (whose
    import took 2 s in every worker): the same pixels and labels as scikit-learn's reader gives."""
    import sklearn.datasets

    reference = sklearn.datasets.load_digits()

    def refused():
        raise AssertionError("scikit-learn's reader was called")

    monkeypatch.setattr(sklearn.datasets, "load_digits", refused)
    builtin._digits_file.cache_clear()
    pixels, labels = builtin._digits_file()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)


def test_digits_train_and_val_partition_the_data():
    train, val = load_dataset("digits", "train"), load_dataset("digits", "val")
    all_images, all_labels = builtin.digits_all()

    def items(images, labels):
        return Counter((bytes(im.numpy().tobytes()), int(y)) for im, y in zip(images, labels))

    full, tr, va = items(all_images, all_labels), items(train.images, train.labels), items(val.images, val.labels)
    assert tr + va == full  # multiset union: nothing lost, nothing duplicated
    assert len(train) + len(val) == 1797


def test_subset_is_class_balanced_and_seeded():
    a = load_dataset("digits", subset=100, seed=0)
    assert len(a) == 100 and torch.bincount(a.labels).tolist() == [10] * 10
    assert torch.equal(a.images, load_dataset("digits", subset=100, seed=0).images)
    assert not torch.equal(a.images, load_dataset("digits", subset=100, seed=1).images)
    b = load_dataset("digits", subset=105)
    assert sorted(torch.bincount(b.labels).tolist()) == [10] * 5 + [11] * 5
    # An under-full class gives its share to the others.
    labels = torch.tensor([0] * 2 + [1] * 50 + [2] * 50)
    pick = D.balanced_subset(labels, 30, seed=0)
    assert torch.bincount(labels[pick]).tolist() == [2, 14, 14]
    with pytest.raises(DataError, match="larger than the dataset"):
        load_dataset("digits", "val", subset=10_000)
    with pytest.raises(DataError, match="positive"):
        load_dataset("digits", subset=0)


def test_bad_arguments():
    with pytest.raises(DataError, match="split"):
        load_dataset("digits", "test")
    with pytest.raises(DataError, match="on_corrupt"):
        load_dataset("digits", on_corrupt="ignore")


# -- ImageFolder --------------------------------------------------------------------------------------
def _save(path: Path, rgb: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(rgb)
    if mode:
        img = img.convert(mode)
    img.save(path)


def _make_folder(root: Path, size: int = 8) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    made: dict[str, list[np.ndarray]] = {}
    for cls, n in (("cat", 3), ("dog", 2), ("emu", 2)):
        for i in range(n):
            arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            ext = ".png" if i % 2 == 0 else ".jpg"
            _save(root / cls / f"{i:02d}{ext}", arr)
            made.setdefault(cls, []).append(arr)
    (root / "cat" / "notes.txt").write_text("not an image")
    _save(root / "emu" / "zz_gray.png", np.full((size, size, 3), 77, np.uint8), mode="L")
    return made


def test_imagefolder_labels_classes_and_pixels(tmp_path):
    made = _make_folder(tmp_path / "train")
    ds = load_dataset(str(tmp_path / "train"), split="ignored")
    assert ds.classes == ["cat", "dog", "emu"]
    assert ds.labels.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert ds.images.shape == (8, 3, 8, 8) and ds.images.dtype == torch.uint8 and ds.images.is_contiguous()
    # PNG is lossless: pixels round-trip exactly, in sorted file order.
    assert torch.equal(ds.images[0], torch.from_numpy(made["cat"][0]).permute(2, 0, 1))
    assert torch.equal(ds.images[7], torch.full((3, 8, 8), 77, dtype=torch.uint8))  # grey -> RGB
    assert all(0 <= m <= 1 for m in ds.mean) and all(0 < s <= 0.5 for s in ds.std)
    assert ds.to("cpu").images.shape == ds.images.shape and len(ds) == 8


def test_imagefolder_resizes_other_sizes_with_warning(tmp_path):
    _make_folder(tmp_path / "d")
    _save(tmp_path / "d" / "dog" / "big.png", np.zeros((12, 20, 3), np.uint8))
    with pytest.warns(UserWarning, match="resized 1 image"):
        ds = load_dataset(str(tmp_path / "d"))
    assert ds.images.shape == (9, 3, 8, 8)


def test_imagefolder_corrupt_skip_and_error(tmp_path):
    _make_folder(tmp_path / "d")
    bad = tmp_path / "d" / "dog" / "broken.jpg"
    bad.write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    with pytest.warns(UserWarning, match="skipped 1 unreadable") as rec:
        ds = load_dataset(str(tmp_path / "d"), on_corrupt="skip")
    assert str(bad) in str(rec[0].message)
    assert len(ds) == 8 and ds.labels.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(DataError, match="broken.jpg"):
        load_dataset(str(tmp_path / "d"), on_corrupt="error")  # also from the cache the first call wrote


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "is empty"),
        (lambda p: (p.mkdir(), (p / "a.txt").write_text("x")), "no image files"),
        (lambda p: ((p / "cat").mkdir(parents=True), (p / "cat" / "a.txt").write_text("x")), "no image files"),
    ],
    ids=["missing", "empty", "flat-without-images", "no-images"],
)
def test_imagefolder_errors_are_one_line(tmp_path, setup, message):
    path = tmp_path / "data"
    setup(path)
    with pytest.raises(DataError, match=message) as err:
        load_dataset(str(path))
    assert "\n" not in str(err.value) and "<class>" in str(err.value)


def test_imagefolder_cache_hit_invalidation_and_location(tmp_path, monkeypatch):
    folder = tmp_path / "d"
    _make_folder(folder)
    first = load_dataset(str(folder))
    cache_files = list(Path(os.environ["UNISON_CACHE_DIR"]).rglob("*.pt"))
    assert len(cache_files) == 1
    assert not any(p.suffix == ".pt" for p in folder.rglob("*"))  # nothing written into the data folder

    def no_decode(*a, **k):
        raise AssertionError("decoded although cached")

    monkeypatch.setattr(memory, "decode_all", no_decode)
    again = load_dataset(str(folder))
    assert torch.equal(again.images, first.images) and torch.equal(again.labels, first.labels)
    # A subset from the full cache equals a subset decoded directly.
    sub_cached = load_dataset(str(folder), subset=4, seed=3)
    monkeypatch.undo()
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    sub_direct = load_dataset(str(folder), subset=4, seed=3)
    assert torch.equal(sub_cached.images, sub_direct.images) and torch.equal(sub_cached.labels, sub_direct.labels)
    assert torch.bincount(sub_direct.labels).tolist() in ([2, 1, 1], [1, 2, 1], [1, 1, 2])
    # A changed folder is decoded again.
    monkeypatch.delenv("UNISON_NO_CACHE")
    _save(folder / "dog" / "new.png", np.zeros((8, 8, 3), np.uint8))
    assert len(load_dataset(str(folder))) == 9


def test_cache_is_never_written_inside_the_data_folder(tmp_path, monkeypatch):
    folder = tmp_path / "d"
    _make_folder(folder)
    monkeypatch.setenv("UNISON_CACHE_DIR", str(folder / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_dataset(str(folder))
    assert not (folder / "cache").exists()


# -- CIFAR-10 -----------------------------------------------------------------------------------------
def test_cifar10_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(*a, **k):
        raise RuntimeError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(DataError, match="without network use a local copy as an ImageFolder") as err:
        load_dataset("cifar10", root=str(tmp_path))
    assert "could not download CIFAR-10" in str(err.value)
    assert "../shared" not in str(err.value)   # no path that only this repository's machines have (issue 15, 18)


def test_real_cifar10_val_folder():
    folder = CIFAR / "val"
    if not folder.is_dir():
        pytest.skip(f"CIFAR-10 folder not found at {folder}")
    ds = load_dataset(str(folder))
    assert ds.images.shape == (5000, 3, 32, 32) and ds.images.dtype == torch.uint8
    assert len(ds.classes) == 10 and ds.classes[0] == "airplane"
    assert torch.bincount(ds.labels).tolist() == [500] * 10
    assert all(abs(m - c) < 0.02 for m, c in zip(ds.mean, D.CIFAR10_MEAN))
