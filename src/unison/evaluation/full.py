"""The protocols of ``unison eval`` that train on the images, ``--fine-tune`` and ``--linear-protocol standard``, on
unison's machinery: every worker builds the same classifier, reads its share of every global batch from the data
layer, and `unison.eval.finetune.fine_tune` trains it.

* **Workers**: one process (``--world-size 1``), ``--world-size N`` processes started by unison's launcher
  (`unison.distributed.launch`: gloo on the CPU, NCCL with a GPU each), or the processes torchrun, srun or mpirun
  started (each runs ``unison eval``; their variables decide the world). W workers of B/W images train like one
  worker of B: the batch norms synchronised (`convert_sync_batchnorm`), the gradients averaged by unison's DDP
  wiring (`unison.parallel.ddp.wrap_ddp`), views, order and drop path drawn from (seed, epoch, index).
* **The backbone**: the checkpoint's, rebuilt as it trained (`unison.training.load.load_method`), or with
  ``--from-scratch`` the run's architecture initialised by the run's seed (`unison.evaluation.fast.scratch_method`).
* **The data**: ``--data``'s labelled images (all, or the ``--labels`` subset drawn with ``--seed``) through
  `unison.data.source.build_batch_source` (in memory or streamed, by the rule `unison train` uses), augmented by
  the recipe's one-view preset at the run's image size and normalised with the run's statistics; scored on every
  ``--val`` image (or ``--val-subset``), centre view.
* **Precision**: the parameters in ``--precision`` (float64 for exactness checks), bf16 autocast on a GPU
  (``--amp auto``).
* **Folder**: ``OUT/<protocol>[-scratch]/``: ``checkpoint.pt`` and ``metrics.csv`` (`unison.eval.finetune_state`);
  ``--resume`` continues from the checkpoint after a stop (SIGTERM/SIGUSR1: exit 75) or a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import ConfigError, DataError

from .options import EvalOptions
from .sets import DataChoice

ALL_IMAGES = 2**62   # a held-out subset "of at most this many": every image


def folder_of(out: Path, protocol: str, scratch: bool) -> Path:
    return out / f"{'linear-standard' if protocol == 'linear' else protocol}{'-scratch' if scratch else ''}"


def family_of(backbone: torch.nn.Module) -> str:
    """``vit`` for transformer backbones (a patch embedding), else ``cnn``: whose paper's recipe applies."""
    return "vit" if hasattr(backbone, "patch_embed") else "cnn"


def recipe_for(opts: EvalOptions, protocol: str, family: str, data: str) -> Any:
    """The protocol's recipe for the backbone's family with `opts`' values; its augmentation a preset of one view
    (default: ``classify``; ``digits_crop`` on the embedded digits, which are not mirror symmetric)."""
    from unison.eval.recipe import resolve_recipe

    default_aug = "digits_crop" if data == "digits" else "classify"
    given = {"epochs": opts.epochs, "batch_size": opts.train_batch_size, "base_lr": opts.lr,
             "optimizer": opts.optimizer, "weight_decay": opts.weight_decay, "layer_decay": opts.layer_decay,
             "warmup_epochs": opts.warmup_epochs, "label_smoothing": opts.label_smoothing,
             "augmentation": opts.augmentation or default_aug}
    if protocol == "fine-tune":
        given.update(drop_path=opts.drop_path, mixup=opts.mixup, cutmix=opts.cutmix)
    recipe = resolve_recipe(protocol, family, given)
    from unison.data.presets import PRESETS

    if recipe.augmentation not in PRESETS or PRESETS[recipe.augmentation]["n_global"] != 1 \
            or PRESETS[recipe.augmentation]["n_local"]:
        one_view = sorted(k for k, v in PRESETS.items() if v["n_global"] == 1 and not v["n_local"])
        raise ConfigError(f"--augmentation {recipe.augmentation!r} is not a preset of one view; give one of "
                          f"{', '.join(one_view)}")
    return recipe


def check_batch(opts: EvalOptions, choice: DataChoice, world: int) -> None:
    """One line, before anything trains, when the labelled images cannot fill one global batch of the training
    protocols, or the batch cannot be split evenly over the workers."""
    from unison.eval.recipe import DEFAULTS

    batch = opts.train_batch_size or int(DEFAULTS[("fine-tune", "cnn")]["batch_size"])
    images = choice.label_images if choice.label_images is not None else choice.data_images
    if images < batch:
        which = f"--labels {opts.labels} gives" if choice.label_images is not None else f"--data {choice.data} has"
        raise ConfigError(f"{which} {images:,} labelled training images, fewer than one global batch of the "
                          f"fine-tuning and the standard linear protocol (--train-batch-size {batch}): give a smaller "
                          "--train-batch-size or more --labels")
    if batch % world:
        raise ConfigError(f"--train-batch-size {batch} (global) cannot be split evenly over {world} workers; give a "
                          f"multiple of {world}, e.g. {max(world, batch // world * world)}")


def run_protocol(opts: EvalOptions, choice: DataChoice, protocol: str, scratch: bool, out: Path,
                 device: str) -> dict[str, Any]:
    """Run one full protocol with ``opts.world_size`` workers (or the launcher's); rank 0's result."""
    from unison.distributed.launch import launch

    payload = {"options": dataclasses.asdict(opts), "data": dataclasses.asdict(choice.spec),
               "label_images": choice.label_images, "data_images": choice.data_images, "label_seed": choice.label_seed,
               "protocol": protocol, "scratch": scratch, "out": str(out), "device": device}
    if launched_world(opts) is not None or opts.world_size == 1:   # this process is a worker
        return protocol_worker(payload)
    cfg = DistributedConfig(world_size=opts.world_size)
    return launch(protocol_worker, payload, cfg, threads_per_worker=opts.threads)[0]


def launched_world(opts: EvalOptions) -> int | None:
    """The world size of the launcher (torchrun, srun, mpirun) that started this process, or None; a different
    ``--world-size`` given with it is refused, as ``unison train`` refuses it."""
    from unison.distributed.env import detect_launch_env

    launch_env = detect_launch_env()
    if launch_env is None:
        return None
    if opts.world_size not in (1, launch_env.world_size):
        raise ConfigError(f"rank {launch_env.rank}: --world-size {opts.world_size} but {launch_env.source} started "
                          f"{launch_env.world_size} worker processes; the launcher decides the world size: leave "
                          "--world-size out")
    return launch_env.world_size


@contextlib.contextmanager
def process_group() -> Iterator[tuple[torch.device, DistributedConfig]]:
    """This process in a group: the one it is in already (the launcher's, joined once for every protocol of a
    ``unison eval`` that torchrun, srun or mpirun started), else the launcher's variables', else a group of one;
    a group joined here is left at the end."""
    import torch.distributed as dist

    from unison.distributed.env import apply_launch_env, detect_launch_env, init_distributed, shutdown_distributed

    launch_env = detect_launch_env()
    dcfg = DistributedConfig(world_size=1, backend="local")
    if launch_env is not None:
        dcfg = apply_launch_env(DistributedConfig(world_size=launch_env.world_size), launch_env)
    local_rank = launch_env.local_rank if launch_env else 0
    if dist.is_initialized():
        yield _device_of(dcfg, local_rank), dcfg
        return
    device = init_distributed(dcfg, local_rank)
    error: BaseException | None = None
    try:
        yield device, dcfg
    except BaseException as exc:
        error = exc
        raise
    finally:
        shutdown_distributed(error)


def _device_of(dcfg: DistributedConfig, local_rank: int) -> torch.device:
    """The device `init_distributed` gave this worker: its GPU under NCCL (or alone with one), else the CPU."""
    if dcfg.communication_backend() == "nccl" or (dcfg.resolved_backend() == "local" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def protocol_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """One worker: in its group (`process_group`), train and score one protocol."""
    from unison.distributed.signals import install_stop_handlers, restore_default_handlers

    opts = EvalOptions(**payload["options"])
    with process_group() as (device, dcfg):
        if payload["device"] == "cpu":
            device = torch.device("cpu")
        install_stop_handlers()
        if opts.threads:
            torch.set_num_threads(opts.threads)
        try:
            return train_and_score(opts, payload, device, dcfg)
        finally:
            if launched_world(opts) is None:
                restore_default_handlers()


def train_and_score(opts: EvalOptions, payload: dict[str, Any], device: torch.device,
                    dcfg: DistributedConfig) -> dict[str, Any]:
    """This rank's part of one protocol: the classifier, its data, `fine_tune`; the result as a dict."""
    from unison.data.spec import DataSpec
    from unison.distributed.collectives import world_size
    from unison.eval.finetune import FineTuneJob, fine_tune
    from unison.eval.mix import check_pairs
    from unison.training.load import load_method, preprocessing

    protocol, scratch = payload["protocol"], payload["scratch"]
    method, cfg, ckpt = load_method(str(opts.checkpoint), device)
    if scratch:
        from .fast import scratch_method

        method = scratch_method(str(opts.checkpoint), cfg, ckpt, device)
    recipe = recipe_for(opts, protocol, family_of(method.backbone), payload["data"]["data"])
    if recipe.mixup or recipe.cutmix:
        check_pairs(recipe.batch_size, world_size())
    pre = preprocessing(cfg, ckpt)
    spec = dataclasses.replace(DataSpec(**payload["data"]), batch_size=recipe.batch_size, world_size=world_size(),
                               val_subset=opts.val_subset or ALL_IMAGES, seed=payload["label_seed"],
                               image_size=pre["image_size"], local_crops=None, local_crop_size=None, grad_sync_every=1,
                               normalisation=(tuple(pre["mean"]), tuple(pre["std"])) if pre["mean"] else None)
    data = build_data(spec, device, recipe.augmentation, cfg)
    job_kwargs = build_classifier(method, data, recipe, opts, cfg, device, dcfg, protocol)
    out = folder_of(Path(payload["out"]), protocol, scratch)
    record = {**{f"recipe.{k}": v for k, v in recipe.as_dict().items()}, "protocol": protocol, "scratch": scratch,
              "labels": opts.labels,
              "label_images": payload["label_images"], "seed": opts.seed, "data": spec.data, "val": spec.val,
              "val_subset": opts.val_subset, "checkpoint_step": int(ckpt["step"]),
              "checkpoint": checkpoint_digest(ckpt), "precision": opts.precision}
    job = FineTuneJob(source=data.source, labels_of=data.labels_at, val_images=data.knn.queries,
                      val_labels=data.knn.query_labels, num_classes=data.knn.num_classes, recipe=recipe,
                      seed=opts.seed, device=device, out=out, record=record, resume=opts.resume,
                      eval_batch_size=opts.batch_size, name=f"{protocol}{' from scratch' if scratch else ''}",
                      before_step=_fault_hook(), **job_kwargs)
    result = fine_tune(job)
    return {"protocol": protocol, "scratch": scratch, "top1": result.scores.top1, "top5": result.scores.top5,
            "val_images": result.scores.images, "unreadable": result.scores.unreadable,
            "train_images": data.num_images, "steps": result.steps, "steps_per_epoch": result.steps_per_epoch,
            "final_loss": result.final_loss, "train_top1": result.train_top1, "resumed_from": result.resumed_from,
            "train_time_s": round(result.train_time_s, 2), "world_size": world_size(), "recipe": recipe.as_dict(),
            "data_mode": data.mode, "image_size": data.image_size, "folder": str(out)}


def build_data(spec: Any, device: torch.device, augmentation: str, cfg: TrainConfig) -> Any:
    """The labelled training images (this rank's share of each global batch) and the held-out set."""
    from unison.data.source import build_batch_source

    data = build_batch_source(spec, device, augmentation)
    if data.knn is None:
        raise DataError(f"no labelled held-out images: {data.knn_skipped}")
    if not data.labelled:
        raise DataError(f"--data {spec.data} has no class labels; fine-tuning needs them")
    return data


def build_classifier(method: Any, data: Any, recipe: Any, opts: EvalOptions, cfg: TrainConfig, device: torch.device,
                     dcfg: DistributedConfig, protocol: str) -> dict[str, Any]:
    """The classifier on its device (synchronised batch norms, drop path) and the job's model-side fields."""
    from unison.data.augment import eval_transform
    from unison.distributed.sync_batchnorm import convert_sync_batchnorm
    from unison.eval.classifier import Classifier, install_drop_path
    from unison.parallel.ddp import wrap_ddp

    dtype = getattr(torch, opts.precision)
    backbone = method.backbone.to(device, dtype)
    classifier = Classifier(backbone, method.feature_dim, data.knn.num_classes, head_init_std=recipe.head_init_std,
                            head_norm=recipe.head_norm, frozen=protocol == "linear", seed=opts.seed)
    keys = install_drop_path(backbone, recipe.drop_path) if protocol == "fine-tune" else None
    convert_sync_batchnorm(classifier, device)   # in place below the root: the classifier's batch norms replaced
    classifier.to(device)
    if cfg.nhwc:
        classifier.to(memory_format=torch.channels_last)
    amp = opts.amp if opts.amp != "auto" else ("bf16" if device.type == "cuda" else "none")
    size, mean, std = data.image_size, data.mean, data.std

    def to_eval(x: torch.Tensor) -> torch.Tensor:
        y = eval_transform(x, size, mean, std).to(dtype)
        return y.contiguous(memory_format=torch.channels_last) if cfg.nhwc else y

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        return wrap_ddp(m, dataclasses.replace(dcfg, sync_batchnorm=True), device)

    return {"model": classifier, "to_eval": to_eval, "wrap": wrap, "dtype": dtype, "drop_path": keys,
            "autocast": torch.bfloat16 if amp == "bf16" else None, "channels_last": bool(cfg.nhwc)}


def checkpoint_digest(ckpt: dict[str, Any]) -> str:
    """A short digest of the checkpoint's weights: a resume must continue from the same encoder."""
    h = hashlib.sha256()
    for name, tensor in sorted((ckpt.get("model") or {}).items()):
        if isinstance(tensor, torch.Tensor):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()[:4096])
    return h.hexdigest()[:16]


def _fault_hook() -> Any:
    """``UNISON_EVAL_STOP_AT_STEP=N`` (the fault tests): this process sends itself SIGTERM before step N, as a
    cluster's preemption notice would; None otherwise."""
    at = os.environ.get("UNISON_EVAL_STOP_AT_STEP")
    if not at:
        return None
    import signal

    def stop(step: int) -> None:
        if step == int(at):
            os.kill(os.getpid(), signal.SIGTERM)

    return stop
