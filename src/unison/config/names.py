"""The closest known name to a mistyped one: the "did you mean" of every unknown option, flag, key or value.

One rule for flags (``--max-step``), config-file keys (``learning_rate:``), ``--param`` names and values such as a
method's name, so each is answered the same way. Closeness is, in order:

* a name other SSL code bases use for one of unison's (`SYNONYMS`: ``learning_rate`` is ``lr``, ``num_gpus`` is
  ``world_size``): spelling alone cannot find these (``learning_rate`` is far from ``lr``). One name can stand for
  several, in order (``ckpt`` is ``--checkpoint`` in ``unison eval``, ``--resume`` in ``unison train``, which has no
  ``--checkpoint``): the first the command knows is suggested;
* the same name written with dashes, or in another case (``max-steps``, ``Batch_Size``);
* a known name that begins with what was given (``max_step``: ``max_steps``; abbreviations are suggested, never
  taken);
* the spelling (`difflib`'s ratio, 0.6 or more).

Hand-written rather than a package's: argparse suggests nothing before Python 3.14 and nothing for config keys.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["SYNONYMS", "closest", "did_you_mean"]

# Names of other SSL code bases and trainers (timm, Lightning, solo-learn, the methods' official repositories) for
# unison's options; a synonym is suggested only where its target is one of the names known there (the first of
# several that is).
SYNONYMS: dict[str, str | tuple[str, ...]] = {
    "learning_rate": "lr", "base_lr": "lr", "blr": "lr", "lr_base": "lr",
    "wd": "weight_decay", "decay": "weight_decay",
    "num_epochs": "epochs", "max_epochs": "epochs", "n_epochs": "epochs", "epoch": "epochs",
    "max_iters": "max_steps", "max_iter": "max_steps", "iterations": "max_steps", "total_steps": "max_steps",
    "num_steps": "max_steps", "steps": "max_steps",
    "bs": "batch_size", "batchsize": "batch_size", "global_batch_size": "batch_size",
    "warmup": "warmup_epochs", "warmup_epoch": "warmup_epochs",
    "arch": "backbone", "model": "backbone", "encoder": "backbone", "network": "backbone",
    "optim": "optimizer", "opt": "optimizer",
    "img_size": "image_size", "input_size": "image_size", "crop_size": "image_size", "resolution": "image_size",
    "size": "image_size",
    "output_dir": "out", "output": "out", "out_dir": "out", "save_dir": "out", "log_dir": "out", "run_dir": "out",
    "dataset": "data", "data_path": "data", "data_dir": "data", "train_dir": "data", "train_data": "data",
    "val_dir": "val", "val_data": "val", "val_path": "val",
    "num_workers": "loader_workers", "workers": "loader_workers",
    "num_gpus": "world_size", "gpus": "world_size", "devices": "world_size", "nproc_per_node": "world_size",
    "nprocs": "world_size", "world": "world_size",
    "accumulate_grad_batches": "grad_sync_every", "grad_accum": "grad_sync_every",
    "gradient_accumulation_steps": "grad_sync_every", "accum_iter": "grad_sync_every",
    "clip_grad": "grad_clip", "gradient_clip_val": "grad_clip", "max_grad_norm": "grad_clip",
    "mixed_precision": "amp", "fp16": "amp", "bf16": "amp", "autocast": "amp",
    "save_every": "checkpoint_every", "ckpt_every": "checkpoint_every", "save_freq": "checkpoint_every",
    "checkpoint_freq": "checkpoint_every",
    "resume_from": "resume", "ckpt": ("checkpoint", "resume"), "ckpt_path": ("checkpoint", "resume"),
    "ckpt_dir": ("checkpoint", "resume"), "weights": ("checkpoint", "init"), "pretrained": "init",
    "random_seed": "seed",
    "syncbn": "sync_batchnorm", "sync_bn": "sync_batchnorm",
    "fsdp": "shard", "zero": "shard",
    "params": "method_params", "hparams": "method_params",
    "budget": "time_budget", "time_limit": "time_budget",
}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` most likely meant (see the module's rules), or None."""
    if not isinstance(name, str) or len(name) > 100:
        return None
    names = [k for k in known if isinstance(k, str)]
    by_key: dict[str, str] = {}
    for k in names:
        by_key.setdefault(_key(k), k)
    key = _key(name)
    meant = SYNONYMS.get(key, ())
    for candidate in (*((meant,) if isinstance(meant, str) else meant), key):
        if candidate in by_key and by_key[candidate] != name:
            return by_key[candidate]
    longer = sorted((k for k in by_key if key and k.startswith(key) and k != key), key=len)
    if longer:
        return by_key[longer[0]]
    close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name (`closest`), or ''."""
    close = closest(name, known)
    return f" (did you mean {close!r}?)" if close else ""
