"""Which data ``unison eval`` reads: ``--data``/``--val`` (default: the run's, where the run read them), the
labelled subset ``--labels`` draws, and the bounded sets kNN and the fast probe embed (`unison.data.evalsets`).

The run's ``--data``/``--val`` are read where the run read them (their absolute form, recorded beside what was
given); an explicit ``--data`` without ``--val`` means that data's own held-out split. ``--labels N|P%``: a
class-balanced subset of N images (or P % of ``--data``) drawn with ``--seed`` (`unison.eval.labels`); the held-out
subset keeps the run's seed, so every ``--labels`` is scored on the same images.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from unison.config import TrainConfig
from unison.errors import ConfigError, DataError
from unison.eval.labels import LabelBudget

from .options import EvalOptions

if TYPE_CHECKING:
    from unison.data.evalsets import KnnSets
    from unison.data.spec import DataSpec


def check_recorded(given: str | None, path: str, flag: str) -> None:
    """A path taken from the run's config (`given` is None) is relative to where the run was started: when it is
    not there from here, say so (a bare "does not exist" points at the wrong folder)."""
    from unison.data.source import BUILTIN

    if given is None and path not in BUILTIN and not Path(path).expanduser().is_absolute() \
            and not os.path.lexists(path):
        raise DataError(f"{path} is the run's recorded {flag}, relative to the folder the run was started in, and "
                        f"there is no {Path(path).absolute()} from here: run unison eval from that folder, or pass "
                        "--data and --val")


def recorded_data(cfg: TrainConfig, ckpt: dict[str, Any]) -> tuple[str, str | None]:
    """The run's ``--data`` and ``--val`` as the run read them: their absolute form, recorded beside what was given
    (``data_path``/``val_path``), so that a relative path works from any folder (older runs: as given)."""
    resolved = ckpt.get("resolved") or {}

    def pick(given: str | None, name: str) -> str | None:
        recorded = resolved.get(f"{name}_path")
        return recorded if given and isinstance(recorded, str) and recorded else given

    return pick(cfg.data, "data") or cfg.data, pick(cfg.val, "val")


def require_labels(classes: list[str], flag: str, path: str) -> None:
    """DataError for data without class labels (kNN and the probe score predicted classes)."""
    if not classes:
        raise DataError(f"{flag} {path} has no class labels; kNN and the linear probe need them: an ImageFolder (one "
                        "subfolder per class), a labelled file list or shards with .cls")


@dataclass
class DataChoice:
    """``--data``/``--val`` resolved: where they are, the subsets, the labelled images' draw."""

    data: str
    val: str
    spec: DataSpec                  # the run's data spec with these (batch size 1: the caller sets its own)
    budget: LabelBudget
    label_images: int | None        # the --labels subset's size (None: every image of --data)
    data_images: int                # images of --data
    label_seed: int


@dataclass
class EvalData:
    """The sets `unison eval` embeds (training's kNN rule, `unison.data.evalsets`) and their preprocessing."""

    sets: KnnSets
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def choose_data(opts: EvalOptions, cfg: TrainConfig, ckpt: dict[str, Any]) -> DataChoice:
    """``--data``/``--val``/``--labels`` of `opts` (default: the run's data), checked; nothing decoded."""
    from unison.data.source import BUILTIN, check_held_out, open_checked
    from unison.data.spec import BUILTIN_IMAGES
    from unison.training.pieces import OWN
    from unison.training.step import data_spec

    run_data, run_val = recorded_data(cfg, ckpt)
    if opts.data is None and run_data.startswith(OWN):
        raise ConfigError(f"{opts.checkpoint} trained on your own dataset {run_data[len(OWN):]}, which unison cannot "
                          "read again: give --data and --val, or unison.evaluate(RUN, dataset=..., val=...)")
    data = opts.data or run_data
    own_data = opts.data is None or opts.data in (cfg.data, run_data)
    # An explicit --data without --val means that data's own held-out split, not the run's --val.
    val = opts.val or (run_val if own_data else None) or data
    own_val = val in (cfg.val or cfg.data, run_val or run_data)
    budget = LabelBudget.parse(opts.labels)
    subset = opts.subset if opts.subset is not None else (cfg.subset if own_data and budget.everything else None)
    val_subset = opts.val_subset if opts.val_subset is not None else (cfg.val_subset if own_val else None)
    if val == data and opts.val is None and data not in BUILTIN:   # a folder, list or shard has no held-out split
        raise DataError(f"no held-out data: --data {data} has no held-out split and no --val was given (nor by the run);"
                        " kNN and the linear probe would be scored on the very images they fit: give --val HELD_OUT")
    check_held_out(val, data)
    check_recorded(opts.data, data, "--data")
    check_recorded(opts.val, val, "--val")
    spec = dataclasses.replace(data_spec(cfg), data=data, val=None if val == data else val, subset=subset,
                               val_subset=val_subset, batch_size=1, data_mode=opts.data_mode or cfg.data_mode)
    catalog = open_checked(spec, "data")
    total = len(catalog) if catalog is not None else min(BUILTIN_IMAGES[data], subset or BUILTIN_IMAGES[data])
    if catalog is not None:
        require_labels(catalog.classes, "--data", data)
    label_images = None if budget.everything else budget.count(total, f"--data {data}")
    if label_images is not None:
        spec = dataclasses.replace(spec, subset=label_images)
    return DataChoice(data, val, spec, budget, label_images, total, opts.seed if label_images is not None else cfg.seed)


def eval_data(choice: DataChoice, cfg: TrainConfig, ckpt: dict[str, Any], device: torch.device) -> EvalData:
    """The reference and held-out sets, bounded and decoded batch by batch as the training loop's kNN reads them,
    with the run's image size and normalisation (recorded in the checkpoint; else training's rule); the reference
    set is drawn from the labelled images."""
    from unison.data.datasets import load_dataset
    from unison.data.evalsets import knn_sets
    from unison.data.source import default_image_size, default_view_size, open_checked, stream_stats, subset_positions
    from unison.training.load import preprocessing

    spec = choice.spec
    catalog, val_catalog = open_checked(spec, "data"), open_checked(spec, "val")
    recorded = preprocessing(cfg, ckpt)
    if val_catalog is not None:
        require_labels(val_catalog.classes, "--val", str(spec.val))
    if catalog is not None:
        pick = subset_positions(catalog, spec.subset, choice.label_seed)
        size = recorded["image_size"] or default_view_size(catalog, spec.data).size
        sets, why = knn_sets(spec, size, device, catalog=catalog, pick=pick, val_catalog=val_catalog)
        stats = (recorded["mean"], recorded["std"]) if recorded["mean"] else stream_stats(catalog, pick, size)
    else:
        train = load_dataset(spec.data, "train", subset=spec.subset, on_corrupt=spec.on_corrupt,
                             seed=choice.label_seed)
        height, width = train.images.shape[-2:]
        size = recorded["image_size"] or default_image_size(height, width, spec.data)
        sets, why = knn_sets(spec, size, device, train_set=train.to(device), val_catalog=val_catalog)
        stats = (recorded["mean"], recorded["std"]) if recorded["mean"] else (train.mean, train.std)
    if sets is None:
        raise DataError(f"no kNN sets: {why}")
    return EvalData(sets, int(size), tuple(stats[0]), tuple(stats[1]))


def object_data(dataset: Any, val: Any, opts: EvalOptions, cfg: TrainConfig, ckpt: dict[str, Any],
                device: torch.device) -> tuple[EvalData, str, str]:
    """The sets of the user's labelled `dataset` (reference) and `val` (held-out) objects, at the run's image size,
    normalised as the run was (or, for a run of the user's own transform, with the reference images' statistics)."""
    from unison.data.own_knn import own_knn_sets
    from unison.data.subsets import channel_stats
    from unison.training.load import preprocessing

    if dataset is None or val is None or opts.data or opts.val:
        raise ConfigError("give both dataset= (labelled reference images) and val= (labelled held-out images), as "
                          "objects, and no data=/val= paths with them")
    if opts.full_protocols or not LabelBudget.parse(opts.labels).everything:
        raise ConfigError("the fine-tuning, the standard linear protocol and --labels read --data and --val (folders, "
                          "file lists, shards or a built-in set): give them as paths, not dataset objects")
    recorded = preprocessing(cfg, ckpt)
    size = int(recorded["image_size"] or cfg.image_size or 32)
    sets = own_knn_sets(dataset, val, size, device, cfg.seed, opts.val_subset)
    if recorded["mean"]:
        mean, std = recorded["mean"], recorded["std"]
    else:
        mean, std = channel_stats(sets.reference.decode(0, 256)[0].cpu())
    names = [f"own:{type(x).__name__}" for x in (dataset, val)]
    return EvalData(sets, size, tuple(mean), tuple(std)), names[0], names[1]


def labels_drawn(choice: DataChoice | None, opts: EvalOptions, reference_images: int,
                 reference_labels: torch.Tensor | None = None) -> dict[str, Any]:
    """What the report says of the labels: the option, how many images of how many, per class, the seed
    (`reference_labels`: the fast protocols' reference set, which holds every labelled image when it is small)."""
    from unison.data.source import open_checked, subset_positions

    if choice is None:   # dataset objects: their reference images
        return {"labels": opts.labels, "images": reference_images, "of": reference_images, "per_class_min": None,
                "per_class_max": None, "seed": opts.seed}
    images = choice.label_images if choice.label_images is not None else choice.data_images
    out: dict[str, Any] = {"labels": choice.budget.text, "images": images, "of": choice.data_images,
                           "per_class_min": None, "per_class_max": None, "seed": choice.label_seed}
    catalog = open_checked(choice.spec, "data")
    if catalog is not None and catalog.classes:
        pick = subset_positions(catalog, choice.spec.subset, choice.label_seed)
        counts = np.bincount(catalog.labels[pick].clip(0), minlength=len(catalog.classes))
        out.update(per_class_min=int(counts.min()), per_class_max=int(counts.max()))
    elif reference_labels is not None and len(reference_labels) == images:   # a built-in set: its drawn labels
        counts = np.bincount(reference_labels.cpu().numpy().clip(0))
        out.update(per_class_min=int(counts.min()), per_class_max=int(counts.max()))
    return out
