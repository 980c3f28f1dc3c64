"""`unison embed` (issue 22, item 11): features of any folder, list or shards, in input order, with the file names,
read as the kNN reads images; outputs never replace an input, nor an existing file without --overwrite."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from unison.cli import main
from unison.config import TrainConfig
from unison.data.generated import write_file_list, write_image_folder, write_shards
from unison.methods import get_method
from unison.models import build_backbone
from unison.training.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 16


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("embed")
    files = write_image_folder(tmp / "data", 21, classes=3, sizes=(18, 50), seed=0)
    (tmp / "data" / "class_1" / "img_000004.png").write_bytes(b"not an image")
    write_file_list(tmp / "data", files, tmp / "list.txt")
    write_shards(tmp / "data", files, tmp / "shards", per_shard=8)
    net, dim = build_backbone("small_cnn", SIZE)
    cls = get_method("simclr")
    save_checkpoint(tmp / "run", {"method": "simclr", "model": cls(net, dim, cls.Params()).state_dict(),
                                  "config": TrainConfig(backbone="small_cnn", image_size=SIZE).to_dict(),
                                  "resolved": {"backbone": "small_cnn", "image_size": SIZE, "mean": [0.5, 0.4, 0.3],
                                               "std": [0.2, 0.2, 0.2]}}, step=0)
    return {"tmp": tmp, "run": tmp / "run", "data": tmp / "data", "list": tmp / "list.txt", "shards": tmp / "shards"}


def _names(out: Path) -> list[list[str]]:
    with open(out.with_name(out.stem + ".names.csv"), newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("layout", ["data", "list", "shards"])
def test_embed_writes_features_and_names_in_input_order(inputs, tmp_path, capsys, layout):
    from unison.data.augment import eval_transform
    from unison.data.catalog import open_catalog
    from unison.data.decode import decode_centre
    from unison.training.load import load_method

    out = tmp_path / "e.npy"
    with pytest.warns(UserWarning, match=r"embed: left out 1 unreadable image\(s\)"):
        assert main(["embed", "--checkpoint", str(inputs["run"]), "--data", str(inputs[layout]), "--out", str(out),
                     "--batch-size", "8"]) == 0
    assert "unison embed: 20 images x" in capsys.readouterr().out
    feats, names = np.load(out), _names(out)
    cat = open_catalog(str(inputs[layout]))
    readable = [i for i in range(len(cat)) if not cat.describe(i).endswith("img_000004.png")]
    assert names[0] == ["file", "label"] and [n[0] for n in names[1:]] == [cat.describe(i) for i in readable]
    assert [n[1] for n in names[1:]] == [cat.classes[cat.labels[i]] for i in readable]
    method, _, _ = load_method(inputs["run"])
    x = torch.stack([torch.from_numpy(decode_centre(cat.read(i), SIZE).copy()).permute(2, 0, 1) for i in readable])
    with torch.no_grad():
        want = method.embed(eval_transform(x, SIZE, (0.5, 0.4, 0.3), (0.2, 0.2, 0.2))).numpy()
    assert feats.shape == want.shape and np.allclose(feats, want, atol=1e-5)


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["embed", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_embed_never_overwrites_an_input_or_an_existing_file(inputs, tmp_path, capsys):
    base = ["--checkpoint", str(inputs["run"]), "--data", str(inputs["data"])]
    out = tmp_path / "e.npy"
    out.write_bytes(b"mine")
    assert "--out " + str(out) + " already exists; it is left as it is: pass --overwrite" in _refused(
        [*base, "--out", str(out)], capsys)
    assert out.read_bytes() == b"mine"
    inside = inputs["data"] / "class_0" / "e.npy"
    assert "which this command reads" in _refused([*base, "--out", str(inside)], capsys) and not inside.exists()
    in_run = inputs["run"] / "checkpoints" / "e.npy"   # where a later file would be taken for a checkpoint
    assert "which this command reads" in _refused([*base, "--out", str(in_run), "--overwrite"], capsys)
    assert "Parquet needs pyarrow" in _refused([*base, "--out", str(tmp_path / "e.parquet")], capsys)
    assert "built-in training set" in _refused([*base[:2], "--data", "digits", "--out", str(tmp_path / "d.npy")], capsys)
    with pytest.warns(UserWarning):
        assert main([*["embed"], *base, "--out", str(out), "--overwrite"]) == 0
    assert np.load(out).shape[0] == 20
