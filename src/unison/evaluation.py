"""`unison eval`: kNN and linear-probe top-1 of a trained checkpoint, in one process.

The method is rebuilt from the checkpoint's stored configuration (`unison.training.load.load_method`),
the training and held-out data default to the run's own (same subsets, same seed, same image size and
normalisation statistics, as recorded in the checkpoint). The images are chosen and read as the training
loop's kNN reads them (`unison.data.evalsets`): at most 5,000 reference images (class-balanced, of the
run's ``--subset`` or of ``--subset N``) and at most 2,000 held-out ones (or ``--val-subset N``), folders,
lists and shards decoded one batch at a time (shorter side resized, centre square, EXIF orientation
applied), so memory does not grow with the data. Unreadable images follow the run's ``--on-corrupt``
(``skip``: left out, one warning with the total). Every image is embedded **once**, with progress on
standard error when it takes more than a few seconds, and both protocols run on those features:

* weighted kNN (k=200, t=0.1: Lightly's benchmark protocol; `unison.eval.knn`) — the same
  number the training loop reports in ``summary.json`` for the same data and k/t;
* a linear probe on the frozen features of the same reference images (`unison.eval.linear`): seconds on CPU.

No process group is needed: without one the collectives are the identity.

A run of your own backbone (``unison.train(cfg, backbone=...)``) is rebuilt from its class when that imports and
builds without arguments (`unison.training.load.own_backbone`; else one line, and ``unison.evaluate(run,
backbone=YourNet(...))`` takes an instance); a run's ``--data``/``--val`` are read where the run read them (their
absolute form, recorded beside what was given); labelled dataset objects replace them through
``unison.evaluate(run, dataset=..., val=...)``.

Example::

    unison eval --checkpoint runs/default                       # kNN + linear on the run's data
    unison eval --checkpoint runs/cifar --no-linear --knn-k 20  # kNN only
    unison eval --checkpoint runs/cifar/checkpoints/step_00000100.pt --json eval.json

An existing ``--json`` file is replaced only with ``--overwrite`` (every command's rule, an earlier eval result
included), never the checkpoint, a data file or a directory there (`unison.paths.check_output`), checked before
anything is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.config import TrainConfig
from unison.config.distributed import checked_device
from unison.config.fields import Range, check_fields, count
from unison.config.train import DATA_LAYOUTS, MAX_BATCH, MAX_EPOCHS
from unison.errors import ConfigError, DataError
from unison.paths import OVERWRITE_HELP

if TYPE_CHECKING:
    from unison.data.evalsets import KnnSets
    from unison.data.spec import DataSpec

DEVICES = ("auto", "cpu", "cuda")
_TRAIN_RANGES = {f.name: f.metadata["range"] for f in dataclasses.fields(TrainConfig) if "range" in f.metadata}


def _as_in_training(name: str) -> Range:
    """The range `unison train` states for the same option (one rule for both commands)."""
    return _TRAIN_RANGES[name]


@dataclass
class EvalOptions:
    checkpoint: str | None = field(default=None, metadata={
        "help": "run directory (its latest checkpoint) or checkpoint file; required", "required": True, "metavar": "RUN_DIR_OR_FILE"})
    data: str | None = field(default=None, metadata={
        "help": f"reference/training data ('digits', 'cifar10', {DATA_LAYOUTS}); default: the run's"})
    val: str | None = field(default=None, metadata={
        "help": "held-out data; default: the run's (or the held-out split of --data when --data is given)"})
    subset: int | None = field(default=None, metadata={"range": _as_in_training("subset"),
        "help": "class-balanced subset of N training images; default: the run's when --data is the run's"})
    val_subset: int | None = field(default=None, metadata={"range": _as_in_training("val_subset"),
        "help": "class-balanced subset of N held-out images; default: the run's when --val is the run's"})
    knn: bool = field(default=True, metadata={"help": "weighted kNN top-1"})
    linear: bool = field(default=True, metadata={"help": "linear probe top-1 on frozen features"})
    knn_k: int = field(default=200, metadata={"range": _as_in_training("knn_k"), "help": "kNN neighbours"})
    knn_t: float = field(default=0.1, metadata={"range": _as_in_training("knn_t"), "help": "kNN temperature"})
    linear_epochs: int = field(default=100, metadata={
        "range": Range(1, MAX_EPOCHS), "help": "linear-probe epochs over the frozen features"})
    linear_lr: float | None = field(default=None, metadata={"range": Range(0, 1e6, lo_open=True),
        "help": "linear-probe learning rate; default: 1e-2 (adam) or 0.5 (sgd)"})
    linear_batch_size: int = field(default=256, metadata={"range": Range(0, MAX_BATCH), "help": "linear-probe mini-batch (0 = full batch)"})
    linear_optimizer: str = field(default="adam", metadata={"help": "linear-probe optimiser",
                                                            "choices": ("adam", "sgd")})
    linear_norm: str = field(default="bn", metadata={
        "help": "feature normalisation: bn (standardise with training statistics), l2 or none",
        "choices": ("bn", "l2", "none")})
    seed: int = field(default=0, metadata={"range": _as_in_training("seed"), "help": "linear-probe seed (data subsets use the run's seed)"})
    batch_size: int = field(default=512, metadata={"range": Range(1, MAX_BATCH), "help": "images per forward pass when embedding"})
    threads: int | None = field(default=None, metadata={
        "range": _as_in_training("threads"), "help": "torch CPU threads; default: torch's (all cores)"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available) | cpu | cuda",
                                                  "choices": DEVICES})
    json: str | None = field(default=None, metadata={
        "help": "also write the results to this JSON file (an existing one only with --overwrite)", "metavar": "PATH"})
    overwrite: bool = field(default=False, metadata={"help": OVERWRITE_HELP + " (--json)"})

    def validate(self) -> EvalOptions:
        if not self.checkpoint:
            raise ConfigError("give --checkpoint RUN_DIR_OR_FILE, e.g. unison eval --checkpoint runs/default")
        if not (self.knn or self.linear):
            raise ConfigError("nothing to evaluate: drop --no-knn or --no-linear")
        check_fields(self)   # types and the stated ranges, as `unison train` checks its options
        checked_device(self.device)   # the one device check (`unison.load_backbone` and every checkpoint read too)
        return self


@torch.no_grad()
def _knn_top1(train_f: torch.Tensor, train_y: torch.Tensor, val_f: torch.Tensor, val_y: torch.Tensor,
              num_classes: int, k: int, t: float, chunk: int = 1024) -> float:
    from unison.eval.knn import knn_predict

    bank = torch.nn.functional.normalize(train_f, dim=1)
    query = torch.nn.functional.normalize(val_f, dim=1)
    correct = 0
    for i in range(0, query.shape[0], chunk):  # chunks bound the [Q, N] similarity matrix
        pred = knn_predict(query[i:i + chunk], bank, train_y, num_classes, k, t)
        correct += int((pred == val_y[i:i + chunk]).sum())
    return correct / query.shape[0]


def _check_recorded(given: str | None, path: str, flag: str) -> None:
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


def _require_labels(classes: list[str], flag: str, path: str) -> None:
    """DataError for data without class labels (kNN and the probe score predicted classes)."""
    if not classes:
        raise DataError(f"{flag} {path} has no class labels; kNN and the linear probe need them: an ImageFolder (one "
                        "subfolder per class), a labelled file list or shards with .cls")


@dataclass
class _EvalData:
    """The sets `unison eval` embeds (training's kNN rule, `unison.data.evalsets`) and their preprocessing."""

    sets: KnnSets
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def _eval_data(spec: DataSpec, cfg: TrainConfig, ckpt: dict[str, Any], device: torch.device) -> _EvalData:
    """The reference and held-out sets, bounded and decoded batch by batch as the training loop's kNN reads them,
    with the run's image size and normalisation (recorded in the checkpoint; else training's rule)."""
    from unison.data.datasets import load_dataset
    from unison.data.evalsets import knn_sets
    from unison.data.source import default_image_size, default_view_size, open_checked, stream_stats, subset_positions
    from unison.training.load import preprocessing

    catalog, val_catalog = open_checked(spec, "data"), open_checked(spec, "val")
    recorded = preprocessing(cfg, ckpt)
    if catalog is not None:
        _require_labels(catalog.classes, "--data", spec.data)
    if val_catalog is not None:
        _require_labels(val_catalog.classes, "--val", str(spec.val))
    if catalog is not None:
        pick = subset_positions(catalog, spec.subset, spec.seed)
        size = recorded["image_size"] or default_view_size(catalog, spec.data).size
        sets, why = knn_sets(spec, size, device, catalog=catalog, pick=pick, val_catalog=val_catalog)
        stats = (recorded["mean"], recorded["std"]) if recorded["mean"] else stream_stats(catalog, pick, size)
    else:
        train = load_dataset(spec.data, "train", subset=spec.subset, on_corrupt=spec.on_corrupt, seed=spec.seed)
        height, width = train.images.shape[-2:]
        size = recorded["image_size"] or default_image_size(height, width, spec.data)
        sets, why = knn_sets(spec, size, device, train_set=train.to(device), val_catalog=val_catalog)
        stats = (recorded["mean"], recorded["std"]) if recorded["mean"] else (train.mean, train.std)
    if sets is None:
        raise DataError(f"no kNN sets: {why}")
    return _EvalData(sets, int(size), tuple(stats[0]), tuple(stats[1]))


def _features(method: Any, images: Any, to_eval: Any, opts: EvalOptions, what: str) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    from unison.eval.knn import embed_all
    from unison.progress import Progress

    return embed_all(method.embed, images, to_eval, opts.batch_size, normalise=False,
                     progress=Progress(f"eval: embedding {what}", images.shape[0]))


def _named_data(opts: EvalOptions, cfg: TrainConfig, ckpt: dict[str, Any],
                device: torch.device) -> tuple[_EvalData, str, str]:
    """The reference and held-out sets of ``--data``/``--val`` (default: the run's), with their names."""
    from unison.data.source import BUILTIN, check_held_out
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
    subset = opts.subset if opts.subset is not None else (cfg.subset if own_data else None)
    val_subset = opts.val_subset if opts.val_subset is not None else (cfg.val_subset if own_val else None)
    if val == data and opts.val is None and data not in BUILTIN:   # a folder, list or shard has no held-out split
        raise DataError(f"no held-out data: --data {data} has no held-out split and no --val was given (nor by the run);"
                        " kNN and the linear probe would be scored on the very images they fit: give --val HELD_OUT")
    check_held_out(val, data)
    _check_recorded(opts.data, data, "--data")
    _check_recorded(opts.val, val, "--val")
    spec = dataclasses.replace(data_spec(cfg), data=data, val=None if val == data else val, subset=subset,
                               val_subset=val_subset, batch_size=1)
    return _eval_data(spec, cfg, ckpt, device), data, val


def _object_data(dataset: Any, val: Any, opts: EvalOptions, cfg: TrainConfig, ckpt: dict[str, Any],
                 device: torch.device) -> tuple[_EvalData, str, str]:
    """The sets of the user's labelled `dataset` (reference) and `val` (held-out) objects, at the run's image size,
    normalised as the run was (or, for a run of the user's own transform, with the reference images' statistics)."""
    from unison.data.own_knn import own_knn_sets
    from unison.data.subsets import channel_stats
    from unison.training.load import preprocessing

    if dataset is None or val is None or opts.data or opts.val:
        raise ConfigError("give both dataset= (labelled reference images) and val= (labelled held-out images), as "
                          "objects, and no data=/val= paths with them")
    recorded = preprocessing(cfg, ckpt)
    size = int(recorded["image_size"] or cfg.image_size or 32)
    sets = own_knn_sets(dataset, val, size, device, cfg.seed, opts.val_subset)
    if recorded["mean"]:
        mean, std = recorded["mean"], recorded["std"]
    else:
        mean, std = channel_stats(sets.reference.decode(0, 256)[0].cpu())
    names = [f"own:{type(x).__name__}" for x in (dataset, val)]
    return _EvalData(sets, size, tuple(mean), tuple(std)), names[0], names[1]


def evaluate_checkpoint(opts: EvalOptions, *, backbone: Any = None, dataset: Any = None,
                        val: Any = None) -> dict[str, Any]:
    """Run kNN and/or the linear probe for `opts`; return the results (what ``--json`` writes). `backbone`: an
    instance for a run of the user's own backbone class (`unison.training.load.own_backbone`); `dataset` and `val`:
    labelled reference and held-out dataset objects, in place of ``--data``/``--val``."""
    from unison.data.augment import eval_transform
    from unison.eval.knn import report_unreadable
    from unison.eval.linear import linear_probe
    from unison.training.load import load_method
    from unison.training.summary import steady_heap

    opts.validate()
    assert opts.checkpoint is not None   # validate() raised ConfigError otherwise
    steady_heap()
    device = torch.device("cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    t0 = time.perf_counter()
    method, cfg, ckpt = load_method(opts.checkpoint, device, backbone=backbone)
    if dataset is not None or val is not None:
        ev, data_name, val_name = _object_data(dataset, val, opts, cfg, ckpt, device)
    else:
        ev, data_name, val_name = _named_data(opts, cfg, ckpt, device)
    dtype = getattr(torch, cfg.precision)

    def to_eval(x: torch.Tensor) -> torch.Tensor:  # as the training loop's kNN: the run's size and mean/std
        y = eval_transform(x, ev.image_size, ev.mean, ev.std).to(dtype)
        return y.contiguous(memory_format=torch.channels_last) if cfg.nhwc else y

    t1 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):   # as training's kNN
        train_f, train_ok = _features(method, ev.sets.reference, to_eval, opts, "the reference set")
        val_f, val_ok = _features(method, ev.sets.queries, to_eval, opts, "the held-out set")
    report_unreadable(int((~train_ok).sum() + (~val_ok).sum()), ev.sets.reference, ev.sets.queries)
    train_f, train_y = train_f[train_ok], ev.sets.reference_labels[train_ok]
    val_f, val_y = val_f[val_ok], ev.sets.query_labels[val_ok]
    if not (len(train_f) and len(val_f)):
        raise DataError("none of the reference or held-out images could be read; fix the data or give other data")
    t2 = time.perf_counter()
    num_classes = ev.sets.num_classes
    result: dict[str, Any] = {
        "unison": "eval", "checkpoint": str(opts.checkpoint), "method": ckpt["method"], "backbone": cfg.backbone,
        "step": int(ckpt["step"]), "data": data_name, "val": val_name, "train_images": len(train_f), "val_images": len(val_f),
        "feature_dim": int(train_f.shape[1]), "knn_top1": None, "linear_top1": None, "linear_train_top1": None,
        "load_time_s": t1 - t0, "feature_time_s": t2 - t1,
    }
    if opts.knn:
        result["knn_top1"] = _knn_top1(train_f, train_y, val_f, val_y, num_classes, opts.knn_k, opts.knn_t)
        result["knn_time_s"] = time.perf_counter() - t2
    if opts.linear:
        t3 = time.perf_counter()
        probe = linear_probe(train_f, train_y, val_f, val_y, num_classes, epochs=opts.linear_epochs,
                             lr=opts.linear_lr, batch_size=opts.linear_batch_size, optimizer=opts.linear_optimizer,
                             normalise=opts.linear_norm, seed=opts.seed)
        result["linear_top1"], result["linear_train_top1"] = probe.top1, probe.train_top1
        result["linear_time_s"] = time.perf_counter() - t3
    from unison.training.summary import peak_memory_mib

    result["peak_memory_mib"] = round(peak_memory_mib(device), 1)   # RSS on the CPU, the allocator's peak on CUDA
    result["options"] = dataclasses.asdict(opts)
    return result


def cmd_eval(ns: argparse.Namespace) -> int:
    from unison.config.fields import overrides_from_namespace
    from unison.errors import DataError

    opts = EvalOptions(**overrides_from_namespace(ns, EvalOptions))
    if opts.json:
        check_json_path(opts)   # before the (slow) evaluation
    try:
        r = evaluate_checkpoint(opts)
    except DataError as e:   # a refused checkpoint stays a CheckpointError (exit 4)
        raise ConfigError(str(e)) from None
    print(f"unison eval: {r['method']} / {r['backbone']} at step {r['step']} ({opts.checkpoint}); "
          f"{r['train_images']} reference and {r['val_images']} held-out images, features in "
          f"{r['feature_time_s']:.1f} s")
    if r["knn_top1"] is not None:
        print(f"  kNN top-1     {r['knn_top1']:.4f}   (k={opts.knn_k}, t={opts.knn_t})")
    if r["linear_top1"] is not None:
        print(f"  linear top-1  {r['linear_top1']:.4f}   ({count(opts.linear_epochs, 'epoch')}, {opts.linear_optimizer}, "
              f"{opts.linear_norm} features; train top-1 {r['linear_train_top1']:.4f}, {r['linear_time_s']:.1f} s)")
    if opts.json:
        from unison.paths import write_text_atomic

        path = write_text_atomic(check_json_path(opts), json.dumps(r, indent=2) + "\n", "--json")
        print(f"  wrote {path}")
    return 0


def is_eval_result(path: Path) -> bool:
    """`path` holds an earlier ``unison eval --json`` result (how a refusal names it)."""
    try:
        if path.stat().st_size > 1 << 20:
            return False
        r = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(r, dict) and (r.get("unison") == "eval" or {"checkpoint", "knn_top1", "linear_top1"} <= set(r))


def check_json_path(opts: EvalOptions) -> Path:
    """``--json``, refused (one line) where it is an input, a directory, or an existing file without --overwrite."""
    from unison.paths import Input, check_output
    from unison.training.load import checkpoint_inputs

    assert opts.json is not None
    inputs = checkpoint_inputs(opts.checkpoint) if opts.checkpoint else []
    inputs += [Input(f"--{name}", getattr(opts, name)) for name in ("data", "val") if getattr(opts, name)]
    return check_output(opts.json, "--json", inputs=inputs, overwrite=opts.overwrite, own=is_eval_result,
                        own_text="an earlier unison eval result")


def add_subcommand(sub: argparse._SubParsersAction, help_text: str) -> None:
    from unison.config.fields import add_options_command

    add_options_command(sub, "eval", help_text,
                        __doc__.splitlines()[0], EvalOptions, cmd_eval)
