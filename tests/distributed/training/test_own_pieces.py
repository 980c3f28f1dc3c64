"""Own pieces in unison's loop, with real worker processes: ``unison.train(cfg, backbone=..., feature_dim=...,
dataset=..., transform=...)`` at 2 workers (each rank its own slice of every global batch, decoded in a loader
process) trains as 1 process on the global batch, and ``unison.check`` proves it with the same objects (and with
an iterable dataset)."""

from __future__ import annotations

import pytest
import torch
from helpers.own_pieces import WIDTH, Photos, PhotoStream, TinyNet, jitter, uneven_views

import unison
from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import DataError


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
