"""Streamed data: folders, file lists and tar shards of images of any size and mode, decoded by loader workers.

The views of a sample must depend on (seed, epoch, index) only: not on the world size, the number
of loader workers or the layout the images are stored in; every sample is read once per epoch."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data_stream import BATCH, SIZE, N, _augmenter, _stream, _take

from unison.data import global_batches
from unison.data.catalog import Catalog, open_catalog
from unison.data.decode import CropDecoder
from unison.data.generated import write_image_folder
from unison.distributed.testing import run_in_workers
from unison.errors import DataError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and all(torch.equal(p, q) for p, q in zip(x[2], y[2]))
        for x, y in zip(a, b))


# -- layouts --------------------------------------------------------------------------------------------
def test_layouts_list_the_same_samples_in_the_same_order(data):
    folder, listed, shards = (open_catalog(data[k]) for k in ("folder", "list", "shards"))
    assert folder.kind == "folder" and listed.kind == "list" and shards.kind == "shards"
    assert len(folder) == len(listed) == len(shards) == N
    assert folder.classes == listed.classes == ["class_0", "class_1", "class_2"] and shards.classes == ["0", "1", "2"]
    assert np.array_equal(folder.labels, listed.labels) and np.array_equal(folder.labels, shards.labels)
    for i in (0, 37, N - 1):
        assert folder.read(i) == listed.read(i) == shards.read(i)
    assert "shard-00000.tar:class_0/" in shards.describe(0)


def test_layouts_give_the_same_views(data):
    job = (2, list(range(0, N, 2)))
    crops = [CropDecoder(open_catalog(data[k]), _augmenter("multicrop"), 7, "skip")(job)["crops"]
             for k in ("folder", "list", "shards")]
    assert len(crops[0]) == 6 and crops[0][0].shape == (N // 2, 3, SIZE, SIZE) and crops[0][0].dtype == torch.uint8
    for other in crops[1:]:
        assert all(torch.equal(a, b) for a, b in zip(crops[0], other))


def test_every_mode_decodes_to_rgb_and_crops_differ(data):
    out = CropDecoder(open_catalog(data["folder"]), _augmenter(), 7, "error")((0, list(range(20))))
    assert out["error"] is None and out["skipped"] == []
    v0, v1 = out["crops"]
    assert not torch.equal(v0, v1)                                  # two different views of each image
    assert len({bytes(x.numpy().tobytes()) for x in v0}) == 20      # and different samples differ


def test_views_do_not_depend_on_the_batch_a_sample_is_in(data):
    dec = CropDecoder(open_catalog(data["shards"]), _augmenter(), 7, "skip")
    big = dec((1, [5, 17, 99, 3]))["crops"]
    alone = dec((1, [99]))["crops"]
    assert all(torch.equal(b[2], a[0]) for b, a in zip(big, alone))


def test_flat_folder_is_unlabelled(tmp_path):
    write_image_folder(tmp_path / "nested", 6, classes=1, sizes=(16, 20))
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in sorted((tmp_path / "nested").rglob("*.*")):
        (flat / p.name).write_bytes(p.read_bytes())
    cat = open_catalog(str(flat))
    assert cat.kind == "flat" and len(cat) == 6 and not cat.labelled and (cat.labels == -1).all()


def test_file_list_labels_comments_and_relative_paths(tmp_path):
    files = write_image_folder(tmp_path / "imgs", 4, classes=2, sizes=(16, 20))
    (tmp_path / "numbers.txt").write_text("# comment\n\n" + "".join(f"imgs/{f} {k % 2}\n" for k, f in
                                                                       enumerate(files)))
    cat = open_catalog(str(tmp_path / "numbers.txt"))
    assert cat.classes == ["0", "1"] and cat.labels.tolist() == [0, 1, 0, 1]
    (tmp_path / "plain.txt").write_text("".join(f"imgs/{f}\n" for f in files))
    assert not open_catalog(str(tmp_path / "plain.txt")).labelled
    (tmp_path / "mixed.txt").write_text(f"imgs/{files[0]}\tcat\nimgs/{files[1]}\n")
    with pytest.raises(DataError, match="line 2 has no label column"):
        open_catalog(str(tmp_path / "mixed.txt"))



def test_file_list_paths_with_spaces_take_a_tab(tmp_path):
    """An absolute path with spaces lost its last word as a label (".../my does not exist", no hint), and one without
    a label could not be listed at all (a trailing tab was stripped). A tab parts a path from its label, and a
    trailing tab ends a path that has none; a space-parted line whose path is missing says how it was read."""
    files = write_image_folder(tmp_path / "my photos", 2, classes=2, sizes=(16, 16))
    paths = [tmp_path / "my photos" / f for f in files]
    listed = tmp_path / "labelled.txt"
    listed.write_text("".join(f"{p}\t{k}\n" for k, p in enumerate(paths)))
    cat = open_catalog(str(listed))
    assert cat.labels.tolist() == [0, 1] and cat.path(0) == str(paths[0])
    unlabelled = tmp_path / "unlabelled.txt"
    unlabelled.write_text("".join(f"{p}\t\n" for p in paths))
    cat = open_catalog(str(unlabelled))
    assert not cat.labelled and [cat.path(i) for i in range(2)] == [str(p) for p in paths]
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("".join(f"{p}\n" for p in paths))   # no tab: the last word is read as a label
    head, word = str(paths[0]).rsplit(" ", 1)
    with pytest.raises(DataError) as info:
        open_catalog(str(spaced))
    assert str(info.value) == (
        f"file list {spaced}: line 1: {head} does not exist (the line was read as the path {head!r} and the label "
        f"{word!r}); {paths[0]} (the whole line) does: a path with spaces is parted from its label by a tab "
        "(path<TAB>label), and ends in a tab when it has no label (path<TAB>)")

# -- one-line errors naming the file -----------------------------------------------------------------------
def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


@pytest.mark.parametrize("case", ["missing-file-in-list", "empty-shard", "zero-byte-shard", "truncated-tar",
                                  "truncated-at-a-member", "compressed-shard", "missing-shard-of-pattern"])
def test_bad_layouts_are_one_line_errors_naming_the_file(data, tmp_path, case):
    png = next(Path(data["folder"]).rglob("*.png")).read_bytes()
    if case == "missing-file-in-list":
        bad = tmp_path / "list.txt"
        bad.write_text(f"{next(Path(data['folder']).rglob('*.png'))}\n{tmp_path / 'gone.jpg'}\n")
        spec, named = str(bad), "gone.jpg"
    elif case == "empty-shard":
        _tar(tmp_path / "a.tar", [("x/1.png", png)])
        _tar(tmp_path / "b.tar", [("x/2.cls", b"1"), ("x/3.txt", b"note")])    # no image member at all
        spec, named = str(tmp_path), "b.tar"
    elif case == "zero-byte-shard":
        (tmp_path / "c.tar").write_bytes(b"")
        spec, named = str(tmp_path / "c.tar"), "c.tar"
    elif case in ("truncated-tar", "truncated-at-a-member"):
        _tar(tmp_path / "full.tar", [(f"x/{k}.png", png) for k in range(4)])
        blob = (tmp_path / "full.tar").read_bytes()
        cut = len(blob) // 2 if case == "truncated-tar" else 512 + ((len(png) + 511) // 512) * 512  # after member 1
        (tmp_path / "cut.tar").write_bytes(blob[:cut])
        spec, named = str(tmp_path / "cut.tar"), "cut.tar"
    elif case == "compressed-shard":
        (tmp_path / "d.tar.gz").write_bytes(b"\x1f\x8b not really")
        spec, named = str(tmp_path / "d.tar.gz"), "d.tar.gz"
    else:
        _tar(tmp_path / "s-0.tar", [("x/1.png", png)])
        spec, named = str(tmp_path / "s-{0..1}.tar"), "s-1.tar"
    with pytest.raises(DataError) as err:
        open_catalog(spec)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory, data) -> str:
    """The folder with two broken files added: random bytes, and a PNG whose pixel data is cut off."""
    root = tmp_path_factory.mktemp("corrupt") / "train"
    files = write_image_folder(root, 48, classes=2, sizes=(16, 40), seed=5)
    assert "class_0/img_000000.jpg" in files and "class_1/img_000003.png" in files
    (root / "class_0" / "img_000000.jpg").write_bytes(np.random.default_rng(0).bytes(700))  # noise
    good = (root / "class_1" / "img_000003.png").read_bytes()
    (root / "class_1" / "img_000003.png").write_bytes(good[: len(good) // 2])                # truncated data
    return str(root)


def test_corrupt_files_are_skipped_with_a_substitute_or_named_in_the_error(corrupt, capfd):
    cat = open_catalog(corrupt)
    bad = [i for i in range(len(cat)) if cat.describe(i).endswith(("img_000000.jpg", "img_000003.png"))]
    assert len(bad) == 2
    source = _stream(corrupt, 0, batch=16, catalog=cat)
    out = _take(source, 0, 3)        # the whole epoch (48 images)
    assert sorted(torch.cat([o[1] for o in out]).tolist()) == list(range(48))
    # recorded with why, each once; the training loop reports them once over its ranks (UnreadableImagesHook)
    assert sorted(name.rsplit("/", 1)[-1] for name in source.skipped) == ["img_000000.jpg", "img_000003.png"]
    assert "skipped" not in capfd.readouterr().err
    # The substitute's pixels, with the unreadable sample's draws: W- and worker-invariant like the rest.
    again = _take(_stream(corrupt, 2, batch=16, catalog=cat), 0, 3)
    assert _same(out, again)
    with pytest.raises(DataError, match=r"cannot read image .*img_00000[03]\.(jpg|png)") as e:
        _take(_stream(corrupt, 1, batch=16, on_corrupt="error"), 0, 3)
    assert "\n" not in str(e.value) and "--on-corrupt skip" in str(e.value)



@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_files_deleted_while_a_run_streams_them_say_the_data_changed(tmp_path, decode):
    """Under the default --on-corrupt skip, a run of unreadable samples has no substitute: the error ended "or pass
    --on-corrupt skip", the option already in effect. Now it says how many failed in a row and that the data may
    have changed since the run listed it (here: deleted after the catalog was made, read by a loader process)."""
    root = tmp_path / "photos"
    write_image_folder(root, 24, classes=1, sizes=(16, 16))
    cat = open_catalog(str(root))
    for i in range(24):   # every file gone: whichever sample comes first, the 10 after it are gone too
        Path(cat.path(i)).unlink()
    with pytest.raises(DataError) as e:
        _take(_stream(str(root), 1, batch=8, catalog=cat, decode=decode), 0, 1)
    message = str(e.value)
    assert "it and the 10 samples after it are unreadable, 11 in a row: " in message, message
    assert message.endswith("and --on-corrupt skip (in effect) found no readable sample to take its place: the data "
                            "may have changed since the run listed it (files deleted, moved or rewritten while it "
                            "ran); restore them, or start the run again on the data as it is now"), message
    assert "or pass --on-corrupt skip" not in message and "\n" not in message

# -- world size, loader workers, reads ---------------------------------------------------------------------
def test_views_do_not_depend_on_the_number_of_loader_workers(data):
    ref = _take(_stream(data["folder"], 0), 0, 7)                        # crosses into epoch 1
    assert [e for e, _, _ in ref] == [0] * 5 + [1] * 2
    assert _same(ref, _take(_stream(data["folder"], 3), 0, 7))
    assert _same(ref[4:], _take(_stream(data["shards"], 2), 4, 3))      # resume mid-run, other layout


def test_gpu_decode_path_is_worker_invariant_too(data):
    # The --decode gpu code (batched torchvision decode_jpeg, roi_align crops) run on the CPU device.
    ref = _take(_stream(data["list"], 0, decode="gpu"), 0, 2)
    assert _same(ref, _take(_stream(data["list"], 2, decode="gpu"), 0, 2))
    assert ref[0][2][0].shape == (BATCH, 3, SIZE, SIZE)


@pytest.mark.parametrize("decode, workers", [("cpu", 0), ("cpu", 1), ("gpu", 0)])
def test_crop_geometry_of_streamed_views_says_where_their_pixels_come_from(tmp_path, decode, workers):
    """Streamed views are cut from each file at its own size (portrait, landscape, square): the source keeps each
    image's size as it reads it, and `crop_geometry` puts every view pixel where it was sampled from (a coordinate
    ramp read back), with the CPU decoders (in this process and a loader process) and the GPU one (on the CPU).
    The CPU path cuts boxes rounded to whole pixels: its views lie within half a pixel of the geometry."""
    from PIL import Image

    from unison.data import ViewAugmenter
    from unison.data.stream import StreamingBatches

    root = tmp_path / "ramps" / "c"
    root.mkdir(parents=True)
    shapes = [(24, 40), (40, 24), (32, 32), (30, 50), (48, 20)]
    for k in range(10):
        h, w = shapes[k % 5]
        ys, xs = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
        ramp = np.stack([xs / w, ys / h, np.zeros_like(xs)], -1)
        Image.fromarray(np.round(ramp * 255).astype(np.uint8)).save(root / f"{k}.png")
    colour_off = dict(jitter_p=0.0, grayscale_p=0.0, blur_p=0.0, solarize_p=0.0)
    aug = ViewAugmenter("simclr", 16, (0.0,) * 3, (1.0,) * 3, **colour_off)
    source = StreamingBatches(open_catalog(str(root.parent)), aug, 5, seed=7, device=torch.device("cpu"),
                              loader_workers=workers, decode=decode)
    o = (torch.arange(16, dtype=torch.float64) * 2 + 1) / 16 - 1
    oy, ox = torch.meshgrid(o, o, indexing="ij")
    points = torch.stack([ox, oy, torch.ones_like(ox)], -1).reshape(-1, 3)
    with pytest.raises(RuntimeError, match="has not yielded"):
        source.crop_geometry(0, torch.tensor([0]))
    it = source.iter_from(0)
    for _ in range(2):
        epoch, idx, views = next(it)
        geometry = source.crop_geometry(epoch, idx)
        hw = torch.tensor([shapes[int(source.decoder.catalog.path(int(i)).rsplit("/", 1)[1][:-4]) % 5] for i in idx],
                          dtype=torch.float64)
        for v, view in enumerate(views):
            where = torch.einsum("bij,pj->bpi", geometry[:, v], points)
            size = hw[:, None, [1, 0]]                                         # (W, H) of each image
            inside = ((where > 4) & (where < size - 4)).all(-1)   # away from the border, where resizing clamps
            seen = view[:, :2].flatten(2).transpose(1, 2).double()
            assert inside.float().mean() > 0.5
            # within the rounding of the CPU path's boxes to whole pixels (half a pixel) and of uint8 (1 / 255)
            error, bound = (seen - where / size).abs(), (0.5 / size + 2 / 255).expand_as(seen)
            assert bool((error[inside] <= bound[inside]).all()), float((error - bound)[inside].max())
    it.close()


def test_memory_mode_reads_lists_and_shards_like_the_folder(data):
    from unison.data import load_dataset

    with pytest.warns(UserWarning, match="resized"):   # the memory path stores every image at one size
        ref = load_dataset(data["folder"], on_corrupt="error")
    for spec in (data["list"], data["shards"]):
        with pytest.warns(UserWarning, match="resized"):
            other = load_dataset(spec, on_corrupt="error")
        assert torch.equal(other.images, ref.images) and torch.equal(other.labels, ref.labels)


# -- with real processes --


def _views_on_this_rank(spec: str, batch: int, workers: int, count: int) -> list:
    return _take(_stream(spec, workers, batch=batch), 0, count)


@pytest.mark.distributed
def test_views_are_bit_identical_at_one_and_two_workers(data):
    multi = run_in_workers(_views_on_this_rank, 2, args=(data["shards"], BATCH, 1, 6), timeout_s=300)
    single = _take(_stream(data["shards"], 0), 0, 6)
    for step, (e, idx, views) in enumerate(single):
        (e0, i0, v0), (e1, i1, v1) = multi[0][step], multi[1][step]
        assert e == e0 == e1 and torch.equal(torch.cat([i0, i1]), idx)
        for v in range(len(views)):
            assert torch.equal(torch.cat([v0[v], v1[v]]), views[v]), f"step {step} view {v}"


class CountingCatalog(Catalog):
    """A catalog that appends ``epoch index`` to a log file for every sample it reads (any process)."""

    log_path = ""
    epoch = -1

    def read(self, i: int) -> bytes:
        with open(self.log_path, "a") as f:
            f.write(f"{self.epoch} {i}\n")
        return super().read(i)


class EpochNotingDecoder:
    """Tells the (per-process) catalog which epoch the job being decoded belongs to."""

    def __init__(self, inner: CropDecoder):
        self.inner = inner

    def __call__(self, job: tuple[int, list[int]]) -> dict:
        self.inner.catalog.epoch = job[0]
        return self.inner(job)


def _read_one_epoch(spec: str, log_path: str, workers: int) -> None:
    from unison.distributed import collectives as C

    cat = open_catalog(spec)
    cat.__class__ = CountingCatalog
    cat.log_path = f"{log_path}.rank{C.rank()}"
    source = _stream(spec, workers, catalog=cat)
    source.decoder = EpochNotingDecoder(source.decoder)
    _take(source, 0, N // BATCH)     # exactly one epoch; the loader may have read ahead into epoch 1


@pytest.mark.distributed
def test_each_sample_is_read_once_per_epoch_across_ranks_and_workers(data, tmp_path):
    log = str(tmp_path / "reads")
    run_in_workers(_read_one_epoch, 2, args=(data["shards"], log, 2), timeout_s=300)
    seen = []
    for rank in (0, 1):
        lines = [line.split() for line in Path(f"{log}.rank{rank}").read_text().splitlines()]
        epoch0 = sorted(int(i) for e, i in lines if e == "0")
        mine = torch.cat([b[rank * BATCH // 2:(rank + 1) * BATCH // 2] for b in global_batches(N, BATCH, 0, 7)])
        assert epoch0 == sorted(mine.tolist())          # this rank's slice of every batch, each sample once
        assert {e for e, _ in lines} <= {"0", "1"}      # read-ahead goes no further than the next epoch
        seen += epoch0
    assert sorted(seen) == list(range(N))               # every sample once per epoch, over both ranks
