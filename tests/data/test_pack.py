"""Packs (`unison.data.pack`): one file of image bytes + an index, read through every path of the other layouts."""

from __future__ import annotations

import os

import pytest
import torch

from unison.config import TrainConfig
from unison.data import load_dataset
from unison.data import source as S
from unison.data.catalog import open_catalog
from unison.data.pack import write_pack
from unison.errors import DataError
from unison.training.step import data_spec


@pytest.fixture(scope="module")
def packs(folders, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("packs")
    out = {}
    for name in ("train", "val", "square"):
        write_pack(open_catalog(folders[name]), tmp / f"{name}.pack")
        out[name] = str(tmp / f"{name}.pack")
    return out


def test_a_pack_holds_the_folders_bytes_labels_and_classes_in_its_order(folders, packs):
    folder, pack = open_catalog(folders["train"]), open_catalog(packs["train"])
    assert pack.kind == "pack" and len(pack) == len(folder) == 48
    assert pack.classes == folder.classes == ["class_0", "class_1"]
    assert pack.labels.tolist() == folder.labels.tolist()
    assert all(pack.read(i) == folder.read(i) for i in range(len(folder)))   # every format, byte for byte
    assert pack.describe(5).endswith(f"train.pack:{folder.names[5]}")


def test_memory_path_decodes_a_pack_to_the_folders_pixels(folders, packs, monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    from_folder, from_pack = load_dataset(folders["square"]), load_dataset(packs["square"])
    assert torch.equal(from_pack.images, from_folder.images) and torch.equal(from_pack.labels, from_folder.labels)


def test_streamed_views_and_knn_sets_of_a_pack_are_the_folders(folders, packs, monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    views = {}
    for where in (folders, packs):
        cfg = TrainConfig(data=where["train"], val=where["val"], data_mode="stream", batch_size=8, loader_workers=0,
                          image_size=16)
        data = S.build_batch_source(data_spec(cfg), torch.device("cpu"), "simclr")
        _, indices, batch = next(data.source.iter_from(0))
        views[where is packs] = (indices, batch, data.knn.queries.decode(0, 12)[0])
    (i0, v0, q0), (i1, v1, q1) = views[False], views[True]
    assert torch.equal(i0, i1) and all(torch.equal(a, b) for a, b in zip(v0, v1)) and torch.equal(q0, q1)


@pytest.mark.parametrize("damage, fragment", [
    (lambda b: b"not a pack at all" + b[17:], "is not a unison pack"),
    (lambda b: b[:-5], "truncated or damaged"),
    (lambda b: b[:20], "truncated or damaged"),
])
def test_a_damaged_pack_is_one_line_naming_it(packs, tmp_path, damage, fragment):
    bad = tmp_path / "bad.pack"
    bad.write_bytes(damage(open(packs["val"], "rb").read()))
    with pytest.raises(DataError, match=fragment) as info:
        open_catalog(str(bad))
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


def test_pack_size_is_the_written_size_without_writing(folders, packs):
    from unison.data.pack import pack_size

    assert pack_size(open_catalog(folders["train"])) == os.path.getsize(packs["train"])
    assert pack_size(open_catalog(packs["train"])) == os.path.getsize(packs["train"])   # a pack of a pack
