"""The config files of ``examples/configs/``: one per method and data set, each the method's recipe written out.

How strict, and why. A file goes stale in three ways, and each fails here:

* **a method without its files** (a method added to `unison.methods.METHODS`): every method must have
  ``<method>_cifar10.yaml`` and ``<method>_imagenet.yaml``;
* **a key that is no option any more, or a value unison refuses**: each file is read by ``unison train``'s own
  ``--config`` reader and validated whole (`validate_run`), and trains one step through ``unison train --config
  FILE`` itself (the second part of this file);
* **a value that no longer matches the recipe**: every recipe value a file spells out (optimizer, lr, weight
  decay, momentum, augmentation, local crops and every field of ``method_params``) must equal what unison
  resolves with that key left out, exactly (the files hold the recipe's floats as written); and ``method_params``
  must hold every field of the method's ``Params``. The rest of a file is its data set's setting (data, image
  size, backbone, schedule, run directory: ``SETTINGS`` of scripts/write_configs.py), which the script owns.
  Finally each file's text must be what ``python scripts/write_configs.py`` writes now, comments included (the
  comment beside ``lr`` quotes the peak learning rate), so the one fix for every failure above is that command.

Every method's file of ``examples/configs/`` trains a step through ``unison train --config FILE``, as a user runs it.

In the second part each file is loaded by ``unison train`` itself (`unison.cli.main`, in this process: one worker) with flags after
``--config`` that make the run small, as a user overrides a file: 16 px stand-in images, a global batch of 4, one
step, the small CNN or ``vit_micro_auto`` in place of the file's ResNet or ViT (the file's own backbone is validated
at the file's image size by the unit test), a random teacher for distill, and no kNN, signals or metrics files;
W-MSE, whose whitening needs more images than a batch of 4, shrinks its covariance (`AT_BATCH_4`).
Everything else (optimizer, lr, weight decay, augmentation, crops, method parameters, schedule) is the file's, and
the run's config.json must show it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from unison.cli import main
from unison.cli.train_args import parse_train_args
from unison.config import TrainConfig
from unison.data.augment import PRESETS
from unison.methods import METHODS
from unison.training.resolve import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
DATASETS = ("cifar10", "imagenet")
FILES = sorted(CONFIGS.glob("*.yaml"))
RECIPE_KEYS = ("optimizer", "lr", "weight_decay", "momentum", "augmentation", "local_crops", "local_crop_size")
REQUIRED = ("optimizer", "lr", "weight_decay", "augmentation")   # every file spells these out
FIX = "run python scripts/write_configs.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("write_configs", ROOT / "scripts" / "write_configs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("write_configs", module)
    spec.loader.exec_module(module)
    return module


def _effective(cfg: TrainConfig) -> dict[str, Any]:
    """What a run of `cfg` trains with, for each recipe key (None: not used)."""
    recipe = resolve_recipe(cfg, cfg.image_size)
    crops = recipe.local_crops if recipe.local_crops is not None else PRESETS[recipe.augmentation]["n_local"]
    momentum = cfg.momentum if recipe.optimizer in ("sgd", "lars") else None   # adam and adamw take none
    return {"optimizer": recipe.optimizer, "lr": recipe.lr, "weight_decay": recipe.weight_decay, "momentum": momentum,
            "augmentation": recipe.augmentation, "local_crops": crops, "local_crop_size": recipe.local_crop_size}


def _teacher(path: Path) -> list[str]:
    """distill's files name a teacher run to train first; the checks use a random teacher in its place."""
    return ["--teacher", "random"] if yaml.safe_load(path.read_text())["method"] == "distill" else []


def test_every_method_has_a_file_per_data_set():
    missing = [f"{m}_{d}.yaml" for m in sorted(METHODS) for d in DATASETS if not (CONFIGS / f"{m}_{d}.yaml").is_file()]
    assert not missing, f"examples/configs/ lacks {', '.join(missing)}: {FIX}"


def test_files_are_what_the_script_writes():
    script = _script()
    stale = script.stale_files()
    assert not stale, f"{', '.join(stale)} missing or out of date: {FIX}"
    extra = sorted(p.name for p in FILES if p not in script.expected_files())   # a method that went
    assert not extra, f"examples/configs/ holds {', '.join(extra)}, which is no method's: delete it"


def test_the_script_check_mode_names_a_stale_file(tmp_path, monkeypatch, capsys):
    """``--check`` is the gate that fails: a file edited by hand is named, and exit 1."""
    script = _script()
    copy = tmp_path / "examples" / "configs"
    copy.mkdir(parents=True)
    expected = script.expected_files()
    for path, text in expected.items():
        if path.suffix == ".yaml":
            (copy / path.name).write_text(text)
    (tmp_path / "methods.md").write_text(expected[script.GUIDE])
    monkeypatch.setattr(script, "CONFIG_DIR", copy)
    monkeypatch.setattr(script, "GUIDE", tmp_path / "methods.md")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 0
    (copy / "simclr_cifar10.yaml").write_text((copy / "simclr_cifar10.yaml").read_text().replace("lr: 0.12", "lr: 0.3"))
    assert script.main(["--check"]) == 1
    assert "configs/simclr_cifar10.yaml is missing or out of date" in capsys.readouterr().err
    (copy / "simclr_cifar10.yaml").write_text(script.render("simclr", "cifar10"))
    guide = (tmp_path / "methods.md").read_text()
    (tmp_path / "methods.md").write_text(guide.replace("simclr_cifar10.yaml)", "simclr.yaml)"))
    assert script.main(["--check"]) == 1                         # the guide's table is checked too
    assert "methods.md is missing or out of date" in capsys.readouterr().err


def recipe_mismatches(path: Path) -> list[str]:
    """How the file at `path` differs from the recipe it spells out, one line each (none: it is the recipe)."""
    cfg = parse_train_args(["--config", str(path), *_teacher(path)])   # the CLI's reader, validated whole
    data = yaml.safe_load(path.read_text())
    problems = []
    params_cls = METHODS[cfg.method].Params
    if data.get("method_params") != dataclasses.asdict(params_cls()):
        problems.append(f"method_params differ from {params_cls.__name__}'s fields and defaults")
    stripped = {k: v for k, v in data.items() if k not in (*RECIPE_KEYS, "method_params")}
    left_out, given = _effective(TrainConfig.from_dict(stripped)), _effective(cfg)
    missing = [k for k in RECIPE_KEYS if k not in data and (left_out[k] or k in REQUIRED)]
    problems += [f"leaves out the recipe's {k}" for k in missing]
    problems += [f"{k}: {data[k]!r} in the file, {left_out[k]!r} in the recipe" for k in RECIPE_KEYS
                 if k in data and given[k] != left_out[k]]
    return problems


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_file_is_the_recipe_written_out(path):
    problems = recipe_mismatches(path)
    assert not problems, f"{path.name}: {'; '.join(problems)}; {FIX}"


@pytest.mark.parametrize("edit", [("lr: 0.12", "lr: 0.3"), ("  temperature: 0.5", "  temperature: 0.2"),
                                  ("augmentation: simclr", "augmentation: byol"), ("weight_decay: 0.0005", "# weight_decay: 0.0005")])
def test_a_value_off_the_recipe_is_found(tmp_path, edit):
    """The check above can fail: a file whose lr, parameter or augmentation is not the recipe's, or that leaves a
    recipe key out."""
    text = (CONFIGS / "simclr_cifar10.yaml").read_text()
    assert edit[0] in text
    changed = tmp_path / "simclr_cifar10.yaml"
    changed.write_text(text.replace(edit[0], edit[1]))
    assert recipe_mismatches(CONFIGS / "simclr_cifar10.yaml") == []
    assert recipe_mismatches(changed)


# -- with real processes --

# One file per method: with the small-run flags below, a method's files for the other data sets train the same code
# (their values differ, and the unit test holds each of them to the recipe at its own image size).
CIFAR_FILES = sorted((ROOT / "examples" / "configs").glob("*_cifar10.yaml"))
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


@pytest.mark.parametrize("path", CIFAR_FILES, ids=[p.stem for p in CIFAR_FILES])
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
