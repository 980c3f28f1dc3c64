"""Choosing the data path (memory / stream), the kNN sets beside it, and a training run on streamed data."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from unison.cli import main
from unison.config import TrainConfig
from unison.data import source as S
from unison.data.spec import DataSpec
from unison.errors import ConfigError, DataError
from unison.training.metrics import MetricsLogger
from unison.training.step import data_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def test_auto_mode_holds_small_data_in_memory_and_streams_the_rest(folders, monkeypatch):
    from unison.data.catalog import open_catalog

    square = open_catalog(folders["square"])
    assert S.choose_mode(DataSpec(data=folders["square"]), square, len(square)) == "memory"
    varied = open_catalog(folders["train"])            # images of many sizes: memory would resize them all
    assert S.choose_mode(DataSpec(data=folders["train"]), varied, len(varied)) == "stream"
    monkeypatch.setattr(S, "MEMORY_BUDGET", 1000)       # 24 images of 20x20x3 bytes do not fit
    assert S.choose_mode(DataSpec(data=folders["square"]), square, len(square)) == "stream"
    cfg = DataSpec(data=folders["train"], data_mode="memory")
    assert S.choose_mode(cfg, varied, len(varied)) == "memory"
    assert S.choose_mode(DataSpec(), None, 0) == "memory"       # the digits
    with pytest.raises(ConfigError, match="built in"):
        S.choose_mode(DataSpec(data_mode="stream"), None, 0)


def test_memory_mode_refuses_data_whose_decoded_copy_exceeds_the_ram(folders, monkeypatch):
    # it decoded for as long as the data took, then the kernel killed every worker (--preset speedrun sets memory)
    from unison.data.catalog import open_catalog

    square = open_catalog(folders["square"])   # 24 images of 20x20: 28,800 bytes decoded
    monkeypatch.setattr(S, "physical_memory", lambda: 28_000)
    with pytest.raises(ConfigError, match=r"--data-mode memory would hold 24 images decoded at 20x20 px .* more than "
                                          r"this machine's .* use --data-mode stream \(or auto\), or fewer images"):
        S.data_mode_of(DataSpec(data=folders["square"], data_mode="memory"), square)
    assert S.data_mode_of(DataSpec(data=folders["square"], data_mode="memory", subset=20), square) == "memory"
    assert S.data_mode_of(DataSpec(data=folders["square"]), square) == "memory"   # auto: its own 2 GiB budget
    monkeypatch.setattr(S, "physical_memory", lambda: None)   # a system that does not say: not refused
    assert S.data_mode_of(DataSpec(data=folders["square"], data_mode="memory"), square) == "memory"


def test_memory_mode_refuses_data_larger_than_the_gpus_free_memory(folders, monkeypatch):
    # on a GPU the decoded images are copied to the device: CUDA's out-of-memory after the whole decode
    from unison.data.catalog import open_catalog

    square = open_catalog(folders["square"])   # 24 images of 20x20: 28,800 bytes decoded
    spec = DataSpec(data=folders["square"], data_mode="memory", batch_size=8)
    monkeypatch.setattr(S, "physical_memory", lambda: 2**40)
    with pytest.raises(ConfigError, match=r"would hold 24 images decoded at 20x20 px .* on each GPU\), more than "
                                          r"the 0.0 GiB free on this GPU; use --data-mode stream"):
        S.data_mode_of(spec, square, device_free=28_000)
    assert S.data_mode_of(spec, square, device_free=28_800) == "memory"
    # the worker asks CUDA for the free memory of its own device, before it decodes anything
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (28_000, 2**34))
    monkeypatch.setattr(S, "load_catalog", lambda *a: pytest.fail("decoded before the check"))
    with pytest.raises(ConfigError, match="free on this GPU"):
        S.build_batch_source(spec, torch.device("cuda", 0), "simclr")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"data_mode": "disk"}, "data_mode='disk' is unknown"),
    ({"decode": "tpu"}, "decode='tpu' is unknown"),
    ({"loader_workers": -1}, "loader_workers=-1 must be an integer >= 0"),
    ({"decode": "gpu"}, "--decode gpu decodes JPEGs on the GPU and this machine has no CUDA device"),
])
def test_data_options_are_validated(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs).validate(cuda_available=False)
    TrainConfig(data_mode="stream", loader_workers=0).validate(cuda_available=False)


def test_data_spec_carries_what_the_data_side_reads_of_the_training_configuration():
    cfg = TrainConfig(data="/d", val="/v", subset=10, val_subset=5, on_corrupt="error", data_mode="stream",
                      loader_workers=3, image_size=32, batch_size=64, seed=7)
    assert data_spec(cfg) == DataSpec(data="/d", batch_size=64, seed=7, val="/v", subset=10, val_subset=5,
                                      on_corrupt="error", data_mode="stream", decode="cpu", loader_workers=3,
                                      image_size=32, world_size=cfg.distributed.world_size)
    assert dataclasses.replace(data_spec(TrainConfig()), world_size=1) == DataSpec()   # TrainConfig's defaults


def test_size_rules_say_the_same_before_the_workers_and_in_the_build(folders):
    """`open_checked` is what the pre-flight and `build_batch_source` both call: one rule, one message."""
    too_big = DataSpec(data=folders["square"], batch_size=8, subset=100)
    with pytest.raises(DataError, match=r"square has 24 images, fewer than --subset/--val-subset 100"):
        S.open_checked(too_big)
    with pytest.raises(DataError, match=r"square has 24 images, fewer than --subset/--val-subset 100"):
        S.build_batch_source(too_big, torch.device("cpu"), "simclr")
    one_batch = DataSpec(data=folders["square"], batch_size=32)
    with pytest.raises(DataError, match=r"square has 24 images, fewer than one global batch \(32\)"):
        S.build_batch_source(one_batch, torch.device("cpu"), "simclr")
    assert S.open_checked(DataSpec(data="digits")) is None and S.open_checked(DataSpec(val=None), "val") is None
    with pytest.raises(DataError, match=r"--val .*val has 12 images, fewer than --subset/--val-subset 13"):
        S.open_checked(DataSpec(val=folders["val"], val_subset=13), "val")


def test_mixed_sizes_train_at_their_median_shorter_side_on_both_paths_and_say_so(tmp_path):
    """A folder of photos of several sizes trained at the shorter side of whichever file sorted first (12 px when a
    12x40 thumbnail did), without a word on the streamed path. One rule (`default_view_size`) for the pre-flight's
    plan and both data paths: the median shorter side of a spread sample, at most 224, and one line saying so."""
    from PIL import Image

    from unison.data.catalog import open_catalog

    for c in ("a", "b"):
        (tmp_path / "mixed" / c).mkdir(parents=True)
        for i, (w, h) in enumerate([(60, 40), (48, 64), (90, 30), (80, 100)] * 2):   # 16 images: all read
            Image.new("RGB", (w, h), (20 * i, 0, 0)).save(tmp_path / "mixed" / c / f"{i:03d}.png")
    Image.new("RGB", (40, 12), (0, 0, 0)).save(tmp_path / "mixed" / "a" / "000.png")   # sorts first: a thumbnail
    where = str(tmp_path / "mixed")
    chosen = S.default_view_size(open_catalog(where), where)
    assert chosen.size == 48   # shorter sides 40, 48, 30, 80, four times each, one 40 replaced by 12: the median
    assert chosen.note == (f"the images of {where} differ in size (shorter sides 12 to 80 px in the 16 read): "
                           "views are 48 px, their median shorter side; --image-size N sets another")
    spec = DataSpec(data=where, batch_size=4)
    assert S.planned_image_size(spec, open_catalog(where)) == 48   # what the pre-flight and `unison plan` take
    for mode in ("stream", "memory"):
        data = S.build_batch_source(dataclasses.replace(spec, data_mode=mode, loader_workers=0), torch.device("cpu"),
                                    "simclr")
        assert (data.mode, data.image_size, data.size_note) == (mode, 48, chosen.note)
    assert tuple(data.train_set.images.shape[-2:]) == (64, 48)   # held at the median image's size, not 12 x 40
    assert S.build_batch_source(spec, torch.device("cpu"), "simclr").mode == "stream"   # auto: mixed sizes stream
    for c in ("a", "b"):   # large photos of two sizes: the median is capped at 224, and the line says so
        (tmp_path / "large" / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (640, 480 + 40 * (i % 2)), (0, 0, 0)).save(tmp_path / "large" / c / f"{i}.png")
    large = S.default_view_size(open_catalog(str(tmp_path / "large")), "large")
    assert large.size == 224 and large.note is not None and "median shorter side, capped at 224" in large.note
    one_size = S.default_view_size(open_catalog(str(tmp_path / "large" / "a")), "a")   # 640x480 and 640x520
    assert one_size.size == 224
    square = tmp_path / "square" / "a"
    square.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (20, 20), (0, 0, 0)).save(square / f"{i}.png")
    assert S.default_view_size(open_catalog(str(tmp_path / "square")), "square") == S.ViewSize(20, None)   # one size
    given = dataclasses.replace(spec, image_size=32)
    assert S.planned_image_size(given, open_catalog(where)) == 32 and S.build_batch_source(
        given, torch.device("cpu"), "simclr").size_note is None   # --image-size: nothing to explain


def test_memory_path_of_a_flat_folder_is_unlabelled(folders):
    from unison.data import load_dataset

    ds = load_dataset(folders["flat"])
    assert len(ds) == 48 and ds.classes == [] and not ds.labelled and bool((ds.labels == -1).all())


def test_metrics_csv_of_an_older_run_gets_the_current_header(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,epoch,loss,lr,images_per_s,knn_top1\n5,1.0,2.5,0.1,100.0,\n")
    logger = MetricsLogger(tmp_path)
    logger.log(step=10, epoch=2.0, loss=2.0, lr=0.1, images_per_s=90.0, data_wait=0.25)
    logger._file.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["5.0", "10"]
    assert rows[0]["data_wait"] == "" and rows[1]["data_wait"] == "0.25" and rows[0]["loss"] == "2.5"


def test_resnet_stem_follows_the_image_size():
    import torchvision

    from unison.models import build_backbone
    from unison.models.backbones import resolve_backbone

    assert resolve_backbone("resnet18", 224) == "resnet18_imagenet" and resolve_backbone("resnet18", 32) == \
        "resnet18_cifar" and resolve_backbone("resnet50", None) == "resnet50_cifar"
    net, dim = build_backbone("resnet18", 224)
    ref = torchvision.models.resnet18()
    ours = {k: v.shape for k, v in net.state_dict().items()}
    assert dim == 512 and ours == {k: v.shape for k, v in ref.state_dict().items() if not k.startswith("fc.")}
    small, _ = build_backbone("resnet18", 32)
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    assert build_backbone("resnet18_cifar", 224)[0].conv1.kernel_size == (3, 3)


def test_waiting_for_data_is_warned_once_with_what_to_change(capsys):
    from types import SimpleNamespace

    from unison.training.trainer import DataWaitWarning

    def warnings_of(mode: str, device: str) -> list[str]:
        run = SimpleNamespace(data=SimpleNamespace(mode=mode, source=SimpleNamespace(loader_workers=2)),
                              device=torch.device(device))
        waits = DataWaitWarning(run)
        for step, share in ((10, 0.9), (20, 0.1), (30, 0.6), (40, 0.7)):   # the first window (start-up) is excused
            waits.observe(step, share)
        return capsys.readouterr().err.splitlines()

    err = warnings_of("stream", "cpu")
    assert len(err) == 1 and "waited for data 60% of the time up to step 30" in err[0]
    assert "raise --loader-workers (now 2)" in err[0]
    assert "in-memory augmentation is the bottleneck" in warnings_of("memory", "cpu")[0]
    # On a GPU the in-memory views are queued kernels: the host's wait is not the augmentation's time
    assert warnings_of("memory", "cuda") == [] and len(warnings_of("stream", "cuda")) == 1


def test_streamed_subset_and_bounded_knn_sets(folders):

    cfg = TrainConfig(data=folders["train"], val=folders["val"], data_mode="stream", subset=20, val_subset=6,
                      batch_size=8, loader_workers=0, image_size=16, knn_reference=10)
    data = S.build_batch_source(data_spec(cfg), torch.device("cpu"), "simclr")
    assert data.mode == "stream" and data.num_images == 20 and data.source.batches_per_epoch == 2
    epoch, indices, views = next(data.source.iter_from(0))
    assert indices.shape == (8,) and int(indices.max()) < 20 and views[0].shape == (8, 3, 16, 16)
    knn = data.knn
    assert knn.reference.shape == (10, 3, 16, 16) and knn.queries.shape == (6, 3, 16, 16)
    assert torch.bincount(knn.reference_labels).tolist() == [5, 5] and knn.num_classes == 2
    decoded, ok = knn.queries.decode(0, 6)
    assert bool(ok.all()) and decoded.dtype == torch.uint8 and decoded.shape == (6, 3, 16, 16)


def test_the_knn_reference_set_is_bounded_unless_asked_for_all():
    """The default bounds each kNN (5,000 class-balanced training images); 0 takes every one, as the published
    kNN figures do (a 5,000-image reference set scores lower than the 45,000 it stands for)."""
    import torch

    from unison.data.evalsets import KNN_REFERENCE, knn_subsets

    labels = torch.arange(12_000) % 10
    queries = torch.arange(300) % 10
    ref, query = knn_subsets(labels, queries, None, seed=0)
    assert len(ref) == KNN_REFERENCE and torch.bincount(labels[ref]).tolist() == [KNN_REFERENCE // 10] * 10
    every, _ = knn_subsets(labels, queries, None, seed=0, reference=0)
    assert sorted(every.tolist()) == list(range(12_000))
    some, _ = knn_subsets(labels, queries, None, seed=0, reference=1_000)
    assert len(some) == 1_000 and len(query) == 300


def test_an_existing_path_named_like_a_brace_pattern_is_what_it_is(tmp_path):
    """A folder ``br{1..2}`` was read as the shards br1, br2 ("tar shard .../br1 of ... does not exist"); only a name
    that does not exist is expanded."""
    from unison.data.catalog import open_catalog
    from unison.data.generated import write_image_folder, write_shards

    folder = tmp_path / "br{1..2}"
    files = write_image_folder(folder, 6, sizes=(12, 12))
    catalog = open_catalog(str(folder))
    assert catalog.kind == "folder" and len(catalog) == 6
    shards = write_shards(folder, files, tmp_path / "shards", per_shard=3)   # shard-00000.tar, shard-00001.tar
    named = shards[0].rename(tmp_path / "shards" / "s-{0..1}.tar")   # one file named like a pattern of two
    assert len(open_catalog(str(named))) == 3
    shards[1].rename(tmp_path / "shards" / "p-1.tar")
    named.rename(tmp_path / "shards" / "p-0.tar")
    assert len(open_catalog(str(tmp_path / "shards" / "p-{0..1}.tar"))) == 6   # a pattern: expanded
    with pytest.raises(DataError, match=r"tar shard .*p-2.tar of .*p-\{0..2\}.tar does not exist"):
        open_catalog(str(tmp_path / "shards" / "p-{0..2}.tar"))


# -- with real processes --


TINY = ["--world-size", "1", "--batch-size", "16", "--epochs", "1", "--no-progress", "--knn-k", "5",
        "--image-size", "16", "--threads", "1"]


def test_streamed_training_run_with_knn_on_held_out_data(folders, tmp_path, capfd):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", folders["train"], "--val", folders["val"], "--data-mode", "stream",
            "--loader-workers", "1", "--out", str(out)]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "streaming 48 images" in err and "1 loader process(es)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_images"] == 48 and summary["val_images"] == 12 and summary["steps"] == 3
    assert 0 <= summary["knn_top1"] <= 1 and 0 <= summary["data_wait_fraction"] <= 1
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["data_mode"] == "stream" and resolved["image_size"] == 16
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert all(0 <= float(r["data_wait"]) <= 1 for r in rows if r["loss"])


@pytest.mark.parametrize("layout, given, why", [
    ("flat", [], "has no labels"), ("train", [], "no --val held-out data"),
    ("train", ["--no-knn"], "skipped: --no-knn"),   # the reason is the flag, not a --val to give
], ids=["flat", "no-val", "no-knn"])
def test_knn_is_skipped_with_one_line_without_labelled_held_out_data(folders, tmp_path, capfd, layout, given, why):
    out = tmp_path / "run"
    assert main(["train", *TINY, *given, "--data", folders[layout], "--max-steps", "1", "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert sum("kNN evaluation skipped" in line for line in captured.err.splitlines()) == 1
    assert why in captured.err and "kNN not measured" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["knn_top1"] is None and summary["val_images"] == 0
