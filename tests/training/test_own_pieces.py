"""Own pieces in `unison.train`: what is refused before any worker starts (one line each), and the views of a
user's transform (a function of (seed, epoch, sample index) only). No process starts in these
(`_no_process_starts`); then training with the pieces at 1 and 2 workers:

Own pieces in unison's loop, with real worker processes: ``unison.train(cfg, backbone=..., feature_dim=...,
dataset=..., transform=...)`` at 2 workers (each rank its own slice of every global batch, decoded in a loader
process) trains as 1 process on the global batch, and ``unison.check`` proves it with the same objects (and with
an iterable dataset)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers.own_pieces import WIDTH, Photos, PhotoStream, TinyNet, jitter, uneven_views

import unison
from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.data.own import build_own_source
from unison.data.spec import DataSpec
from unison.errors import ConfigError, DataError, UnisonError


def _refuse(*args, **kwargs):
    raise AssertionError("the bad piece was not refused: a worker process started")


@pytest.fixture(autouse=True)
def _no_process_starts(request, monkeypatch):
    """The in-process tests: a worker process starting means a bad piece went past the refusals."""
    import multiprocessing.process

    if request.node.get_closest_marker("distributed") is None:
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)


class _Strings(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return f"photo_{i}.jpg"


class _Bright(Photos):
    def __getitem__(self, i):
        return self.images[i].float()   # 0 to 255 as float: not in [0, 1]


def _local_net():
    class Local(nn.Module):   # defined in a function: pickle cannot name it
        def forward(self, x):
            return x.mean((2, 3))

    return Local()


class _Endless(torch.utils.data.IterableDataset):   # no __len__
    def __iter__(self):
        return iter([torch.zeros(3, 8, 8)] * 8)


def _uint8_views(image):
    return (image, image)


CASES = {  # name: (pieces, world size, error class, fragment of the message)
    "lambda transform": (dict(dataset=Photos(), transform=lambda im: im.float()), 2, ConfigError,
                         "transform= cannot be sent to the worker processes"),
    "local backbone class": (dict(backbone=_local_net(), feature_dim=3), 2, ConfigError,
                             "backbone= cannot be sent to the worker processes"),
    "item not an image": (dict(dataset=_Strings()), 1, DataError, "item 0 of _Strings is str, not an image"),
    "float item out of range": (dict(dataset=_Bright()), 1, DataError, "float image with values outside [0, 1]"),
    "wrong feature_dim": (dict(backbone=TinyNet(), feature_dim=WIDTH * 2), 1, ConfigError,
                          f"returns (2, {WIDTH}) for 2 images of 10x10 px; it must return [batch, feature_dim] = "
                          f"(2, {WIDTH * 2})"),
    "feature_dim without backbone": (dict(feature_dim=8), 1, ConfigError, "backbone= and feature_dim= go together"),
    "not a module": (dict(backbone="resnet18", feature_dim=8), 1, ConfigError,
                     "backbone='resnet18' (str) must be an nn.Module or None; a backbone by name is an option: "
                     "TrainConfig(backbone='resnet18')"),
    "transform without dataset": (dict(transform=jitter), 1, ConfigError, "give dataset= too"),
    "transform returns uint8": (dict(dataset=Photos(), transform=_uint8_views), 1, ConfigError,
                                "view 0 is a torch.uint8 tensor (3, 12, 12); a view must be a float tensor"),
    "MAE without a ViT": (dict(backbone=TinyNet(), feature_dim=WIDTH, dataset=Photos()), 2, ConfigError,
                          "MAE needs a ViT backbone with patch tokens"),
    "VICRegL with a transform": (dict(dataset=Photos(), transform=jitter), 1, ConfigError,
                                 "--method vicregl matches its views by where they lie in the image"),
    "iterable without len or max_steps": (dict(dataset=_Endless()), 1, ConfigError,
                                          "dataset _Endless is iterable without __len__"),
    "an iterator": (dict(dataset=iter([torch.zeros(3, 8, 8)] * 8)), 1, ConfigError, "is an iterator (list_iterator)"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_piece_is_one_line_before_any_worker(case, tmp_path):
    pieces, world, error, fragment = CASES[case]
    if case == "wrong feature_dim":
        pieces = dict(pieces, dataset=Photos(), transform=jitter)   # the views' size (10 px) is the dummy batch's
    out = tmp_path / "run"
    method = "mae" if "MAE" in case else "vicregl" if "VICRegL" in case else "simclr"
    config = TrainConfig(method=method, batch_size=8, epochs=1, max_steps=None if "iterable" in case else 1,
                         out=str(out), progress=False, distributed=DistributedConfig(world_size=world))
    with pytest.raises(UnisonError) as caught:   # refused before a worker: `_no_process_starts` fails it otherwise
        unison.train(config, **pieces)
    assert isinstance(caught.value, error), caught.value
    message = str(caught.value)
    assert fragment in message and "\n" not in message
    assert not (out / "config.json").exists()   # refused before the run wrote anything


class _ArrayPhotos(torch.utils.data.Dataset):   # its images in one NumPy array of 96 KiB
    def __init__(self):
        self.pixels = np.random.default_rng(0).integers(0, 256, (32, 3, 32, 32), dtype=np.uint8)

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        return torch.from_numpy(self.pixels[i])


def test_a_dataset_holding_a_large_numpy_array_goes_to_the_workers(tmp_path):
    """Pickled with protocol 5, an array over 64 KiB arrives as a `pickle.PickleBuffer`: the check must pass it
    (it passes the pre-flight and reaches the start of the worker processes, which `_no_process_starts` stops)."""
    config = TrainConfig(method="simclr", batch_size=8, epochs=1, max_steps=1, progress=False,
                         out=str(tmp_path / "run"), distributed=DistributedConfig(world_size=2))
    with pytest.raises(AssertionError, match="a worker process started"):
        unison.train(config, dataset=_ArrayPhotos())


def _views(transform, global_batch: int, dataset=None) -> dict[int, list[torch.Tensor]]:
    """Sample index -> its views in epoch 0, through the source a run reads."""
    spec = DataSpec(data="own", batch_size=global_batch, seed=3, loader_workers=0)   # in this process
    data = build_own_source(spec, torch.device("cpu"), "simclr", dataset or Photos(), transform)
    out = {}
    for _, (epoch, indices, views) in zip(range(32 // global_batch), data.source.iter_from(0)):
        assert epoch == 0
        for row, i in enumerate(indices.tolist()):
            out[i] = [v[row] for v in views]
    return out


def test_a_transforms_views_depend_on_the_sample_not_the_batch():
    """The same sample's views whether it is read in a batch of 32 or of 8; the caller's RNGs are left as they were."""
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = (torch.rand(()), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    whole, parts = _views(jitter, 32), _views(jitter, 8)
    assert (torch.rand(()), random.random(), np.random.rand()) == expected   # restored around every call
    assert whole.keys() == parts.keys() == set(range(32))
    for i in whole:
        assert all(torch.equal(a, b) for a, b in zip(whole[i], parts[i]))
    assert not torch.equal(whole[0][0], whole[0][1])   # two views of one sample differ


def test_an_iterable_dataset_of_float_hwc_images_reads_in_its_order():
    """unison's augmentation of an iterable's items (float HWC in [0, 1]): the views of the map-style dataset of
    the same uint8 images, sample for sample, when read in the same order."""
    stream = _views(None, 8, PhotoStream())
    assert sorted(stream) == list(range(32))
    spec = DataSpec(data="own", batch_size=8, seed=3, loader_workers=0)
    data = build_own_source(spec, torch.device("cpu"), "simclr", Photos(), None)
    first = torch.arange(8)
    expected = data.augment(Photos().images[:8], first, 0, 3)
    assert all(torch.allclose(stream[i][v], expected[v][i], atol=1e-6) for i in range(8) for v in range(2))


def test_unisons_views_of_your_dataset_come_with_their_crops():
    """Without a transform, unison's augmentation cuts every item's views from an image of the items' size: the
    source says where (`crop_geometry`, what VICRegL locates its cells by), also before it has made a batch itself
    (loader processes made them); a transform's views have no crop unison knows."""
    spec = DataSpec(data="own", batch_size=8, seed=3, loader_workers=0)
    data = build_own_source(spec, torch.device("cpu"), "simclr", Photos(), None)
    indices = torch.arange(4, 12)
    size = torch.tensor(Photos().images.shape[-2:]).expand(8, 2)
    expected = data.augment.view_geometry(indices, 2, 3, size)
    assert torch.equal(data.source.crop_geometry(2, indices), expected)
    next(iter(data.source.iter_from(0)))
    assert torch.equal(data.source.crop_geometry(2, indices), expected)
    with pytest.raises(ConfigError, match="leave transform= out"):
        build_own_source(spec, torch.device("cpu"), "simclr", Photos(), jitter).source.crop_geometry(0, indices)


# -- with real processes --

def test_own_backbone_dataset_and_transform_at_two_workers_train_as_one(tmp_path):
    net, photos = TinyNet(), Photos()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    common = dict(method="simclr", batch_size=8, epochs=1, max_steps=2, precision="float64", progress=False,
                  signal_images=8, threads=1, checkpoint_async=False)
    runs = {}
    for world, loader_workers in ((1, 0), (2, 1)):   # and the views do not depend on the loader processes
        cfg = TrainConfig(out=str(tmp_path / f"w{world}"), loader_workers=loader_workers, **common,
                          distributed=DistributedConfig(backend="gloo" if world > 1 else "local", world_size=world))
        runs[world] = unison.train(cfg, backbone=net, feature_dim=WIDTH, dataset=photos, transform=jitter)
    one, two = runs[1].loss_curve, runs[2].loss_curve
    assert [step for step, _ in one] == [step for step, _ in two] == [1, 2]   # the loss of every step
    assert max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(two, one)) < 1e-12, (one, two)   # float64: sum order
    assert runs[2].backbone == "own:helpers.own_pieces.TinyNet" and runs[2].data == "own:helpers.own_pieces.Photos"
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())   # the object passed is not trained

    # the trained weights: unison export writes the backbone's state_dict, which loads into the user's class
    assert main(["export", "--checkpoint", str(tmp_path / "w2"), "--out", str(tmp_path / "bb.pt")]) == 0
    trained = TinyNet()
    trained.load_state_dict(torch.load(tmp_path / "bb.pt"))
    assert not torch.equal(trained.conv.weight, net.conv.weight)

    report = unison.check("simclr", 2, backbone=net, feature_dim=WIDTH, dataset=photos, transform=jitter, steps=2,
                          local_batch=4)
    assert report.passed, report.summary()   # SyncBN in the user's backbone: without it the ranks' statistics differ
    assert "transform own:jitter" in report.summary()
    # an iterable dataset (float HWC items) with unison's augmentation: every rank reads it all, keeps its slice
    stream = unison.check("simclr", 2, backbone=net, feature_dim=WIDTH, dataset=PhotoStream(), steps=2, local_batch=4)
    assert stream.passed, stream.summary()


def test_a_data_error_in_a_loader_process_arrives_as_one_line(tmp_path):
    """A DataError raised by unison in a loader process (here: the transform's views differ in size within a batch)
    arrived as 'Caught DataError in DataLoader worker process 0.' and torch's whole 'Original Traceback'."""
    cfg = TrainConfig(method="simclr", batch_size=8, max_steps=4, progress=False, signal_images=0, threads=1,
                      random_init_knn=False, loader_workers=1, out=str(tmp_path / "run"),
                      distributed=DistributedConfig(backend="local", world_size=1))
    with pytest.raises(DataError) as caught:
        unison.train(cfg, dataset=Photos(), transform=uneven_views)
    message = str(caught.value)
    assert "within one batch; every view must have one size (end with a crop or resize to a fixed size)" in message
    assert "Caught" not in message and "Traceback" not in message and "\n" not in message, message
