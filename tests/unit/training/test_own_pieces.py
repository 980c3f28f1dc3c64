"""Own pieces in `unison.train`: what is refused before any worker starts (one line each), and the views of a
user's transform (a function of (seed, epoch, sample index) only). No process starts here (`_no_process_starts`);
training with the pieces at 1 and 2 workers is tests/distributed/training/test_own_pieces.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers.own_pieces import WIDTH, Photos, PhotoStream, TinyNet, jitter

import unison
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.data.own import build_own_source
from unison.data.spec import DataSpec
from unison.errors import ConfigError, DataError, UnisonError


def _refuse(*args, **kwargs):
    raise AssertionError("the bad piece was not refused: a worker process started")


@pytest.fixture(autouse=True)
def _no_process_starts(monkeypatch):
    import multiprocessing.process

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
