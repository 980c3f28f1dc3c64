"""Every method's file of ``examples/configs/`` trains a step through ``unison train --config FILE``, as a user runs it.

What the files hold, and how strictly they are held to the recipe: tests/unit/cli/test_example_configs.py. Here
each file is loaded by ``unison train`` itself (`unison.cli.main`, in this process: one worker) with flags after
``--config`` that make the run small, as a user overrides a file: 16 px stand-in images, a global batch of 4, one
step, the small CNN or ``vit_micro_auto`` in place of the file's ResNet or ViT (the file's own backbone is validated
at the file's image size by the unit test), a random teacher for distill, and no kNN, signals or metrics files;
W-MSE, whose whitening needs more images than a batch of 4, shrinks its covariance (`AT_BATCH_4`).
Everything else (optimizer, lr, weight decay, augmentation, crops, method parameters, schedule) is the file's, and
the run's config.json must show it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from unison.cli import main

ROOT = Path(__file__).resolve().parents[3]
# One file per method: with the small-run flags below, a method's files for the other data sets train the same code
# (their values differ, and the unit test holds each of them to the recipe at its own image size).
FILES = sorted((ROOT / "examples" / "configs").glob("*_cifar10.yaml"))
# parameters whose file value asks the run to size them from the data (config.json records the size it chose)
SIZED_BY_THE_RUN = {"distill": {"queue_size"}}
# what a method needs beyond the common flags to train at a global batch of 4: W-MSE whitens its 64-wide embedding
# over more than 64 images, or with shrinkage, which its own refusal at this batch names
AT_BATCH_4 = {"wmse": {"w_eps": 0.1}}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """A labelled ImageFolder of 16 px images, train/ and val/, standing in for CIFAR-10 and ImageNet."""
    from PIL import Image

    root = tmp_path_factory.mktemp("stand_in")
    for split, per_class in (("train", 4), ("val", 2)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (16, 16), (40 * i, 120 * c, 200 - 30 * i)).save(folder / f"{i}.png")
    return root


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_file_trains_a_step(path, stand_in, tmp_path, capsys):
    data = yaml.safe_load(path.read_text())
    vit = str(data["backbone"]).startswith("vit_")
    small = ["--data", str(stand_in / "train"), "--val", str(stand_in / "val"), "--image-size", "16",
             "--batch-size", "4", "--max-steps", "1", "--world-size", "1",
             "--backbone", "vit_micro_auto" if vit else "small_cnn", "--amp", "none",
             "--no-knn", "--no-random-init-knn", "--signal-images", "0", "--logger", "none", "--no-progress",
             "--out", str(tmp_path / "run"), *(["--teacher", "random"] if data["method"] == "distill" else []),
             *(["--local-crop-size", "8"] if "local_crop_size" in data else []),
             *[f"--param={k}={v}" for k, v in AT_BATCH_4.get(data["method"], {}).items()]]
    assert main(["train", "--config", str(path), *small]) == 0, capsys.readouterr().err[-2000:]
    ran = json.loads((tmp_path / "run" / "config.json").read_text())
    assert ran["method"] == data["method"]
    changed = {k for k, v in data["method_params"].items() if ran["method_params"][k] != v}
    assert changed <= SIZED_BY_THE_RUN.get(data["method"], set()) | set(AT_BATCH_4.get(data["method"], {})), changed
    for key in ("optimizer", "lr", "weight_decay", "augmentation"):
        assert ran["resolved"][key] == data[key], key
    assert ran["epochs"] == data["epochs"] and ran["warmup_epochs"] == data["warmup_epochs"]
