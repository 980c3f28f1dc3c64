"""`unison eval`: kNN and linear-probe top-1 of a trained checkpoint, in one process.

The method is rebuilt from the checkpoint's stored configuration (`unison.training.load.load_method`),
the training and held-out data default to the run's own (same subsets, same seed, same
normalisation statistics), every image is embedded **once** with the eval transform, and
both protocols run on those features:

* weighted kNN (k=200, t=0.1: Lightly's benchmark protocol; `unison.eval.knn`) — the same
  number the training loop reports in ``summary.json`` for the same data and k/t;
* a linear probe on the frozen features (`unison.eval.linear`): seconds on CPU.

No process group is needed: without one the collectives are the identity.

Example::

    unison eval --checkpoint runs/default                       # kNN + linear on the run's data
    unison eval --checkpoint runs/cifar --no-linear --knn-k 20  # kNN only
    unison eval --checkpoint runs/cifar/checkpoints/step_00000100.pt --json eval.json

``--json`` replaces its own output only: an existing file there must be an earlier ``unison eval`` result
(refused otherwise, like the checkpoint, a data file or a directory there; `unison.paths.check_output`),
checked before anything is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.config import TrainConfig
from unison.config.fields import Range, check_fields
from unison.config.train import MAX_BATCH, MAX_EPOCHS
from unison.errors import ConfigError, DataError

if TYPE_CHECKING:
    from unison.data.tensor_dataset import ImageTensorDataset

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
        "help": "reference/training data (as train's --data: 'digits', 'cifar10', an image folder, a file "
                "list or .tar shards); default: the run's"})
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
        "help": "also write the results to this JSON file (an existing one is replaced only if it is an earlier "
                "unison eval result)", "metavar": "PATH"})

    def validate(self) -> EvalOptions:
        if not self.checkpoint:
            raise ConfigError("give --checkpoint RUN_DIR_OR_FILE, e.g. unison eval --checkpoint runs/default")
        if not (self.knn or self.linear):
            raise ConfigError("nothing to evaluate: drop --no-knn or --no-linear")
        check_fields(self)   # types and the stated ranges, as `unison train` checks its options
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is available; use --device cpu")
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


def _load_labelled(path: str, split: str, flag: str, subset: int | None, cfg: TrainConfig) -> ImageTensorDataset:
    """`load_dataset`, refusing data without class labels (kNN and the probe score predicted classes)."""
    from unison.data.datasets import load_dataset

    data = load_dataset(path, split, subset=subset, on_corrupt=cfg.on_corrupt, seed=cfg.seed)
    if not data.labelled:
        raise DataError(f"{flag} {path} has no class labels; kNN and the linear probe need them: an ImageFolder (one "
                        "subfolder per class), a labelled file list or shards with .cls")
    return data


def evaluate_checkpoint(opts: EvalOptions) -> dict[str, Any]:
    """Run kNN and/or the linear probe for `opts`; return the results (what ``--json`` writes)."""
    from unison.data.augment import eval_transform
    from unison.data.source import BUILTIN, check_held_out, default_image_size
    from unison.eval.linear import extract_features, linear_probe
    from unison.training.load import load_method, preprocessing

    opts.validate()
    assert opts.checkpoint is not None   # validate() raised ConfigError otherwise
    device = torch.device("cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    t0 = time.perf_counter()
    method, cfg, ckpt = load_method(opts.checkpoint, device)
    data = opts.data or cfg.data
    own_data = opts.data is None or opts.data == cfg.data
    # An explicit --data without --val means that data's own held-out split, not the run's --val.
    val = opts.val or (cfg.val if own_data else None) or data
    own_val = val == (cfg.val or cfg.data)
    subset = opts.subset if opts.subset is not None else (cfg.subset if own_data else None)
    val_subset = opts.val_subset if opts.val_subset is not None else (cfg.val_subset if own_val else None)
    if val == data and opts.val is None and data not in BUILTIN:   # a folder, list or shard has no held-out split
        raise DataError(f"no held-out data: --data {data} has no held-out split and no --val was given (nor by the run);"
                        " kNN and the linear probe would be scored on the very images they fit: give --val HELD_OUT")
    check_held_out(val, data)
    _check_recorded(opts.data, data, "--data")
    _check_recorded(opts.val, val, "--val")
    train = _load_labelled(data, "train", "--data", subset, cfg).to(device)
    held = _load_labelled(val, "val", "--val", val_subset, cfg).to(device)
    if held.classes != train.classes:
        raise ConfigError(f"the held-out data {val} has classes {held.classes[:5]}... but the training data {data} "
                          f"has {train.classes[:5]}...; pass matching --data and --val")
    if val == data and data not in ("digits", "cifar10"):
        print(f"unison: warning: no held-out folder, evaluating on the training folder {data}; pass --val",
              file=sys.stderr)
    height, width = train.images.shape[-2:]   # the size the encoder was trained at, else training's default rule
    image_size = preprocessing(cfg, ckpt)["image_size"] or default_image_size(height, width, data)
    dtype = getattr(torch, cfg.precision)

    def to_eval(x: torch.Tensor) -> torch.Tensor:  # as in training: the *training* set's mean/std
        return eval_transform(x, image_size, train.mean, train.std).to(dtype)

    t1 = time.perf_counter()
    train_f = extract_features(method.embed, train.images, to_eval, opts.batch_size)
    val_f = extract_features(method.embed, held.images, to_eval, opts.batch_size)
    t2 = time.perf_counter()
    num_classes = len(train.classes)
    result: dict[str, Any] = {
        "unison": "eval", "checkpoint": str(opts.checkpoint), "method": ckpt["method"], "backbone": cfg.backbone,
        "step": int(ckpt["step"]), "data": data, "val": val, "train_images": len(train), "val_images": len(held),
        "feature_dim": int(train_f.shape[1]), "knn_top1": None, "linear_top1": None, "linear_train_top1": None,
        "load_time_s": t1 - t0, "feature_time_s": t2 - t1,
    }
    if opts.knn:
        result["knn_top1"] = _knn_top1(train_f, train.labels, val_f, held.labels, num_classes, opts.knn_k, opts.knn_t)
        result["knn_time_s"] = time.perf_counter() - t2
    if opts.linear:
        t3 = time.perf_counter()
        probe = linear_probe(train_f, train.labels, val_f, held.labels, num_classes, epochs=opts.linear_epochs,
                             lr=opts.linear_lr, batch_size=opts.linear_batch_size, optimizer=opts.linear_optimizer,
                             normalise=opts.linear_norm, seed=opts.seed)
        result["linear_top1"], result["linear_train_top1"] = probe.top1, probe.train_top1
        result["linear_time_s"] = time.perf_counter() - t3
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
        print(f"  linear top-1  {r['linear_top1']:.4f}   ({opts.linear_epochs} epochs, {opts.linear_optimizer}, "
              f"{opts.linear_norm} features; train top-1 {r['linear_train_top1']:.4f}, {r['linear_time_s']:.1f} s)")
    if opts.json:
        from unison.paths import write_text_atomic

        path = write_text_atomic(check_json_path(opts), json.dumps(r, indent=2) + "\n", "--json")
        print(f"  wrote {path}")
    return 0


def is_eval_result(path: Path) -> bool:
    """`path` holds an earlier ``unison eval --json`` result (what ``--json`` may replace)."""
    try:
        if path.stat().st_size > 1 << 20:
            return False
        r = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(r, dict) and (r.get("unison") == "eval" or {"checkpoint", "knn_top1", "linear_top1"} <= set(r))


def check_json_path(opts: EvalOptions) -> Path:
    """``--json``, refused (one line) where it is an input, a directory or a file that is not an eval result."""
    from unison.paths import Input, check_output
    from unison.training.load import checkpoint_inputs

    assert opts.json is not None
    inputs = checkpoint_inputs(opts.checkpoint) if opts.checkpoint else []
    inputs += [Input(f"--{name}", getattr(opts, name)) for name in ("data", "val") if getattr(opts, name)]
    return check_output(opts.json, "--json", inputs=inputs, own=is_eval_result,
                        own_text="an earlier unison eval result")


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    from unison.config.fields import add_dataclass_arguments

    p = sub.add_parser("eval", help="kNN and linear-probe top-1 of a checkpoint (one process)",
                       description=__doc__.splitlines()[0])
    add_dataclass_arguments(p, EvalOptions)
    p.set_defaults(func=cmd_eval)
