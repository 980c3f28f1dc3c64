"""`unison eval` and the training loop's kNN read the same bounded sets the same way (issue 22, items 1, 3, 6, 7).

* eval streams: images of any size are decoded batch by batch at the run's size (shorter side, centre square),
  never all at once nor stretched to the first one's size, and its kNN equals the training loop's;
* one rule bounds the kNN sets in both data modes, and long phases show progress;
* unreadable images are left out of the kNN sets, reported once as one total, without PIL's raw text;
* held-out labels are checked against the training labels before any worker starts, mapped when unambiguous.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from unison.cli import main
from unison.config import TrainConfig
from unison.data import source as S
from unison.data.generated import write_image_folder
from unison.errors import ConfigError
from unison.eval.knn import knn_accuracy
from unison.methods import get_method
from unison.models import build_backbone
from unison.training.checkpoint import save_checkpoint
from unison.training.step import data_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 16


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """Variable-size training and held-out folders (RGB JPEGs and PNGs), and a held-out copy with two unreadable
    files (noise, a truncated PNG) and a garbled PNG."""
    tmp = tmp_path_factory.mktemp("evalsets")
    modes = (("RGB", "JPEG", ".jpg"), ("RGB", "PNG", ".png"))
    write_image_folder(tmp / "train", 40, classes=2, sizes=(18, 60), seed=1, modes=modes)
    write_image_folder(tmp / "val", 16, classes=2, sizes=(18, 60), seed=2, modes=modes)
    write_image_folder(tmp / "bad_val", 16, classes=2, sizes=(18, 60), seed=2, modes=modes)
    (tmp / "bad_val" / "class_0" / "img_000000.jpg").write_bytes(np.random.default_rng(0).bytes(700))  # noise
    cut = tmp / "bad_val" / "class_1" / "img_000003.png"
    cut.write_bytes(cut.read_bytes()[:200])                                                         # truncated
    png = tmp / "bad_val" / "class_1" / "img_000001.png"   # PIL reads it; torchvision's libpng decoder crashed
    png.write_bytes(_garbled_png())
    return {k: tmp / k for k in ("train", "val", "bad_val")} | {"tmp": tmp}


def _garbled_png() -> bytes:
    """A PNG whose header reads and whose pixel data is garbled (torchvision's libpng decoder crashed on it)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[len(data) // 2:len(data) // 2 + 20] = b"x" * 20
    return bytes(data)


def _checkpoint(run: Path, cfg: TrainConfig) -> None:
    torch.manual_seed(0)
    net, dim = build_backbone("small_cnn", SIZE)
    cls = get_method("simclr")
    method = cls(net, dim, cls.Params())
    state = {"method": "simclr", "config": cfg.to_dict(), "model": method.state_dict(),
             "resolved": {"backbone": "small_cnn", "image_size": SIZE, "mean": [0.5, 0.4, 0.3],
                          "std": [0.2, 0.25, 0.3]}}
    save_checkpoint(run, state, step=0)


def _training_knn(cfg: TrainConfig, run: Path) -> float:
    """The training loop's kNN (`knn_top1`'s call) on the run's data, with the checkpoint's encoder."""
    from unison.data.augment import eval_transform
    from unison.training.load import load_method

    method, _, _ = load_method(run)
    data = S.build_batch_source(data_spec(cfg), torch.device("cpu"), "simclr")
    k = data.knn
    to_eval = lambda x: eval_transform(x, SIZE, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))  # noqa: E731
    return knn_accuracy(method.embed, k.reference, k.reference_labels, k.queries, k.query_labels, to_eval,
                        k.num_classes, k=5)


def _cfg(sets: dict[str, Path], val: str = "val", **kw) -> TrainConfig:
    return TrainConfig(data=str(sets["train"]), val=str(sets[val]), backbone="small_cnn", image_size=SIZE,
                       batch_size=8, knn_k=5, loader_workers=0, **kw)


@pytest.mark.parametrize("mode", ["stream", "memory"])
def test_eval_reads_like_the_training_knn_and_gives_its_number(sets, tmp_path, capfd, mode):
    """Item 1: eval stretched every image to the first one's size ("resized 549 image(s) to 853x493") and scored
    another number than the training loop's kNN; now one path, one number, in either data mode."""
    cfg = _cfg(sets, data_mode=mode)
    _checkpoint(tmp_path / "run", cfg)
    capfd.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--no-linear", "--knn-k", "5",
                 "--json", str(tmp_path / "e.json")]) == 0
    out, err = capfd.readouterr()
    assert "resized" not in err and "Traceback" not in err, err
    import json

    result = json.loads((tmp_path / "e.json").read_text())
    assert result["train_images"] == 40 and result["val_images"] == 16
    assert result["knn_top1"] == _training_knn(cfg, tmp_path / "run")


def test_knn_sets_are_bounded_and_identical_in_both_data_modes(sets, monkeypatch):
    """Item 3: the in-memory path embedded the whole training set (45k CIFAR images, 11+ minutes, no output);
    now both modes take the same class-balanced reference subset and read the same pixels."""
    import unison.data.evalsets as E

    monkeypatch.setattr(E, "KNN_QUERIES", 6)
    built = {m: S.build_batch_source(data_spec(_cfg(sets, data_mode=m, knn_reference=10)), torch.device("cpu"),
                                     "simclr").knn
             for m in ("memory", "stream")}
    mem, stream = built["memory"], built["stream"]
    assert mem.reference.shape == stream.reference.shape == (10, 3, SIZE, SIZE)
    assert mem.queries.shape == (6, 3, SIZE, SIZE)
    assert torch.equal(mem.reference_labels, stream.reference_labels)
    assert torch.equal(mem.reference.decode()[0], stream.reference.decode()[0])
    assert torch.equal(mem.queries.decode()[0], stream.queries.decode()[0])


def test_long_knn_phases_show_progress(monkeypatch, capfd):
    """Item 3: the kNN printed nothing for minutes; a phase longer than a few seconds says what it does."""
    import unison.progress as P

    monkeypatch.setattr(P, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(P, "PROGRESS_EVERY_S", 0.0)
    images = torch.randint(0, 256, (20, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(20) % 2
    knn_accuracy(lambda x: x.flatten(1), images[:12], labels[:12], images[12:], labels[12:], lambda x: x.float(),
                 2, k=3, batch_size=5)
    err = capfd.readouterr().err.splitlines()
    assert "unison: kNN: embedding the reference set 5/12 images" in err[0]
    assert any("kNN: embedding the reference set 12/12 images" in line for line in err)
    assert any("kNN: embedding the queries 8/8 images" in line for line in err)


def test_unreadable_knn_images_are_left_out_and_counted_once(sets):
    """Item 6: broken held-out files stayed black with their labels, warned per rank with PIL's
    "<_io.BytesIO object at 0x...>"; now --on-corrupt skip leaves them out and one warning gives the total."""
    from unison.data.evalsets import LazyImages

    bad = S.build_batch_source(data_spec(_cfg(sets, val="bad_val")), torch.device("cpu"), "simclr").knn
    assert isinstance(bad.queries, LazyImages)
    encode = lambda x: x.float().mean((2, 3))  # noqa: E731   colour means: the garbled files' stand-ins matter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = [knn_accuracy(encode, bad.reference, bad.reference_labels, bad.queries, bad.query_labels,
                            lambda x: x, 2, k=5) for _ in range(2)]
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and lines[0].startswith("kNN: left out 2 unreadable image(s) (--on-corrupt skip), e.g. "), lines
    assert "BytesIO" not in lines[0] and "0x" not in lines[0]
    # The same number as the held-out set without those two files (not black images with their labels).
    images, ok = bad.queries.decode()
    assert int((~ok).sum()) == 2
    want = knn_accuracy(encode, bad.reference, bad.reference_labels, images[ok], bad.query_labels[ok],
                        lambda x: x, 2, k=5)
    assert acc[0] == acc[1] == want


def test_eval_reports_unreadable_images_as_one_line(sets, tmp_path, capfd):
    """Item 6, the command: one warning line, no raw UserWarning, libpng or object addresses."""
    _checkpoint(tmp_path / "run", _cfg(sets, val="bad_val"))
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:   # main() shows each as "unison: warning: MESSAGE"
        warnings.simplefilter("always")
        assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--knn-k", "5", "--linear-epochs", "2"]) == 0
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and lines[0].startswith("kNN: left out 2 unreadable image(s)"), lines
    err = capfd.readouterr().err
    assert not any(s in err + lines[0] for s in ("UserWarning", "libpng", "BytesIO", "Traceback")), err


def test_memory_path_reads_a_garbled_png_without_crashing(sets, capfd):
    """Item 6: torchvision's PNG decoder printed ``libpng error:`` and crashed the process (SIGSEGV) on this file;
    PIL decodes every format now and the file is one of the skipped ones."""
    from unison.data.catalog import open_catalog
    from unison.data.memory import load_catalog

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_catalog(open_catalog(str(sets["bad_val"])), None, "skip", 0)
    assert len(ds) == 14 and "skipped 2 unreadable image(s)" in str(caught[0].message)
    assert "libpng" not in capfd.readouterr().err


def _labelled_list(sets: dict[str, Path], labels: dict[str, str]) -> Path:
    """The training folder as a file list whose labels are `labels[class folder]`."""
    root = sets["train"]
    lines = [f"{p}\t{labels[p.parent.name]}" for p in sorted(root.rglob("img_*"))]
    out = sets["tmp"] / f"list-{'-'.join(labels.values())}.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


def _renamed_val(sets: dict[str, Path], names: dict[str, str]) -> Path:
    """The held-out folder with its class folders renamed (`names`); classes not named are left out."""
    out = sets["tmp"] / f"val-{'-'.join(names.values())}"
    if not out.exists():
        for p in sorted(sets["val"].rglob("img_*")):
            if p.parent.name in names:
                target = out / names[p.parent.name] / p.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(p.read_bytes())
    return out


def test_integer_labels_against_named_classes_fail_before_any_worker(sets, tmp_path):
    """Item 7: a list labelled 0/1 with a --val folder of names failed in the workers; now the pre-flight says
    what to change, in one line."""
    from unison.training.resolve import resolve_run

    data = _labelled_list(sets, {"class_0": "0", "class_1": "1"})
    cfg = TrainConfig(data=str(data), val=str(sets["val"]), batch_size=8, out=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg)
    msg = str(e.value)
    assert "label classes differently" in msg and "integer labels" in msg and "\n" not in msg
    assert not (tmp_path / "run").exists()


def test_unambiguous_label_spaces_are_mapped(sets, tmp_path):
    """Item 7: a held-out folder holding some of the classes, named by the list's integers or by its names, maps
    onto the training labels by name (it failed in the workers: "--val ... has classes [...] but --data ...")."""
    from unison.training.preflight import preflight
    from unison.training.resolve import resolve_run

    for labels in ({"class_0": "0", "class_1": "1"}, {"class_0": "cat", "class_1": "dog"}):
        data, val = _labelled_list(sets, labels), _renamed_val(sets, {"class_1": labels["class_1"]})
        cfg = TrainConfig(data=str(data), val=str(val), batch_size=8, image_size=SIZE, data_mode="stream",
                          loader_workers=0, out=str(tmp_path / val.name))
        preflight(resolve_run(cfg), launched=False)
        knn = S.build_batch_source(data_spec(cfg), torch.device("cpu"), "simclr").knn
        assert knn.num_classes == 2 and knn.query_labels.tolist() == [1] * 8


def test_training_knn_embeds_in_batches_of_the_training_share():
    """Item 2: the kNN embedded 512 images per pass whatever the run's batch: the peak memory of a streamed run
    rose with the reference set (a 300-image share at 600 images, 512 at 6,000: +24-29 % peak RSS per worker)."""
    from types import SimpleNamespace

    from unison.training.trainer import knn_top1

    images = torch.randint(0, 256, (300, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(300) % 2
    knn = S.KnnSets(images[:200], labels[:200], images[200:], labels[200:], 2)
    seen: list[int] = []

    def embed(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x.float().mean((2, 3))

    method = SimpleNamespace(training=False, eval=lambda: None, train=lambda mode: None, embed=embed)
    run = SimpleNamespace(data=SimpleNamespace(knn=knn), method=method, device=torch.device("cpu"),
                          autocast_dtype=None, global_batch=16, to_eval=lambda x: x.float(),
                          cfg=SimpleNamespace(knn_k=5, knn_t=0.1))
    assert knn_top1(run) is not None
    assert max(seen) == 64 and sum(seen) == 300   # the reference set and the queries, 64 at a time


def test_lazy_images_decode_on_the_same_threads_every_batch(sets, monkeypatch):
    """Item 2: a thread pool per batch gave each batch new threads (and malloc arenas): the kNN's peak memory
    grew with the number of batches decoded (+130 MiB on one rank at 6,000 images)."""
    import threading

    import unison.data.evalsets as E

    threads: set[int] = set()
    real = E.decode_centre

    def spy(data: bytes, size: int):
        threads.add(threading.get_ident())
        return real(data, size)

    monkeypatch.setattr(E, "decode_centre", spy)
    knn = S.build_batch_source(data_spec(_cfg(sets)), torch.device("cpu"), "simclr").knn
    for start in range(0, 40, 4):
        knn.reference.decode(start, start + 4)
    assert len(threads) <= min(8, os.cpu_count() or 1)


def test_in_memory_runs_decode_their_knn_images_once(sets, monkeypatch):
    """A kNN every few epochs of an in-memory run decoded the same JPEGs each time (10-15 s per kNN of a
    5-minute H100 run, and the final one overran its time budget by that much); in memory mode the kNN images
    are decoded once, when the data is built, and every kNN gives the same number. Streamed runs decode at
    each kNN (their memory must not grow with the data)."""
    import unison.data.evalsets as E

    decoded: list[int] = []
    real = E.decode_centre
    monkeypatch.setattr(E, "decode_centre", lambda data, size: decoded.append(1) or real(data, size))
    encode = lambda x: x.float().mean((2, 3))  # noqa: E731
    for mode in ("memory", "stream"):
        decoded.clear()
        knn = S.build_batch_source(data_spec(_cfg(sets, data_mode=mode)), torch.device("cpu"), "simclr").knn
        counts, accs = [len(decoded)], []
        for _ in range(2):
            decoded.clear()
            accs.append(knn_accuracy(encode, knn.reference, knn.reference_labels, knn.queries, knn.query_labels,
                                     lambda x: x, 2, k=5, batch_size=7))
            counts.append(len(decoded))
        every = knn.reference.shape[0] + knn.queries.shape[0]
        # (the build decodes some images in either mode: the memory one decodes every kNN image as well)
        assert counts[1:] == ([0, 0] if mode == "memory" else [every, every]), (mode, counts)
        assert accs[0] == accs[1]


@pytest.mark.parametrize("subset", [None, 24])
def test_an_in_memory_runs_knn_reference_is_its_training_images_not_a_second_decode(tmp_path, monkeypatch, subset):
    """Images of one size at the run's size (CIFAR-10 at 32 px): the training decode already holds every
    reference image as the kNN would decode it, so the reference set is taken from it (a second decode of the
    45,000 CIFAR-10 images cost an in-memory run's start-up seconds of its budget); the queries, another
    catalog, are decoded. The pixels are the ones a streamed run's kNN decodes."""
    import unison.data.evalsets as E

    modes = (("RGB", "JPEG", ".jpg"), ("RGB", "PNG", ".png"), ("L", "JPEG", ".jpg"))
    write_image_folder(tmp_path / "train", 40, classes=2, sizes=(SIZE, SIZE), seed=1, modes=modes)
    write_image_folder(tmp_path / "val", 12, classes=2, sizes=(SIZE, SIZE), seed=2, modes=modes)
    cfg = TrainConfig(data=str(tmp_path / "train"), val=str(tmp_path / "val"), backbone="small_cnn", image_size=SIZE,
                      batch_size=8, knn_k=5, loader_workers=0, subset=subset, knn_reference=20)
    decoded: list[int] = []
    real = E.decode_centre
    monkeypatch.setattr(E, "decode_centre", lambda data, size: decoded.append(1) or real(data, size))
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    knn = S.build_batch_source(data_spec(replace(cfg, data_mode="memory")), torch.device("cpu"), "simclr").knn
    assert len(decoded) == knn.queries.shape[0] and knn.reference.shape[0] == 20
    assert isinstance(knn.reference, torch.Tensor)   # the training images' rows, as for a set given in memory
    streamed = S.build_batch_source(data_spec(replace(cfg, data_mode="stream")), torch.device("cpu"), "simclr").knn
    assert torch.equal(knn.reference, streamed.reference.decode()[0])   # the same images, the same pixels
    assert torch.equal(knn.reference_labels, streamed.reference_labels)

    decoded.clear()   # another size for the kNN than the images have: decoded (resized) as before
    knn = S.build_batch_source(data_spec(replace(cfg, data_mode="memory", image_size=SIZE - 4)), torch.device("cpu"),
                               "simclr").knn
    assert len(decoded) == knn.queries.shape[0] + knn.reference.shape[0]


def test_each_rank_keeps_only_its_share_of_the_knn_images(sets, monkeypatch):
    """Rank 1 of 2 embeds the second half of each kNN set: it decodes and holds that half only (the first
    version held a buffer of the whole set on every rank), and its slice of the set decodes nothing more."""
    import unison.data.evalsets as E

    knn = S.build_batch_source(data_spec(_cfg(sets, data_mode="stream")), torch.device("cpu"), "simclr").knn
    ref = knn.reference
    monkeypatch.setattr(E, "rank", lambda: 1)
    monkeypatch.setattr(E, "world_size", lambda: 2)
    decoded: list[int] = []
    real = E.decode_centre
    monkeypatch.setattr(E, "decode_centre", lambda data, size: decoded.append(1) or real(data, size))
    ref.keep_share("reference set")
    n, half = ref.shape[0], -(-ref.shape[0] // 2)
    assert len(decoded) == n - half and ref.kept.images.shape[0] == n - half
    decoded.clear()
    mine = ref[half:n]
    assert torch.equal(mine.decode(0, n - half)[0], ref.kept.images) and decoded == []
    ref.decode(0, 2)   # rows of rank 0's share: decoded, not kept
    assert len(decoded) == 2 and ref.kept.images.shape[0] == n - half


def test_freed_blocks_of_a_phase_leave_the_heap():
    """Item 2: glibc raised its mmap threshold to the largest block freed (up to 32 MiB); blocks below it then
    stayed in the heap once freed, so the kNN of a larger reference set left a higher peak (+230 MiB per
    worker at 20,000 vs 2,000 images). `steady_heap` (every training, eval and embed process) fixes it."""
    import sys

    from unison.training.summary import steady_heap

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc")

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    steady_heap()
    big = np.ones(16 * 2**20, np.uint8)   # freed: glibc used to raise its threshold to 16 MiB here
    del big
    before = rss_mib()
    for _ in range(4):
        block = np.ones(8 * 2**20, np.uint8)   # mapped, and unmapped when freed
        del block
    assert rss_mib() - before < 4
