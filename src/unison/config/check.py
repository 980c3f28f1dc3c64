"""What `unison check` takes: the options of the step check (`CheckSpec`) and of whole runs (`CurveSpec`), with
their tolerances. Plain dataclasses in the configuration layer, so the CLI is generated from them without importing
torch (`unison --help` stays fast); `unison.equivalence` runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from unison.config.distributed import DistributedConfig
from unison.config.fields import Range
from unison.config.train import DATA_LAYOUTS, MAX_BATCH, MAX_STEPS, TrainConfig

__all__ = ["CURVE_TOLERANCE", "TOLERANCE", "CheckSpec", "CurveSpec"]

TOLERANCE = {"float64": 1e-6, "float32": 1e-3}


def _as_in_training(name: str) -> Range:
    """The range of `unison train`'s option `name` (`TrainConfig`'s, else `DistributedConfig`'s): the check runs the
    production step with these values, so it takes what training takes, and says so in the check's own names."""
    fields = {f.name: f for cls in (DistributedConfig, TrainConfig) for f in dataclasses.fields(cls)}
    return fields[name].metadata["range"]


@dataclass
class CheckSpec:
    method: str = field(default="simclr", metadata={"help": "method to check, several separated by commas, or 'all'"})
    world_size: int = field(default=2, metadata={"range": _as_in_training("world_size"),
                                                 "help": "worker processes of the distributed run"})
    steps: int = field(default=4, metadata={"range": Range(1, MAX_STEPS), "help": "optimiser steps compared"})
    local_batch: int = field(default=8, metadata={"range": Range(1, MAX_BATCH),
                                                  "help": "samples per worker (the reference uses W times as many)"})
    image_size: int = field(default=16, metadata={"range": _as_in_training("image_size"),
                                                  "help": "image size of the synthetic data"})
    backbone: str | None = field(default=None, metadata={
        "help": "backbone; default: the method's recipe (small_cnn, or a ViT for the methods that need one)"})
    dtype: str = field(default="float64", metadata={"help": "float64 (tolerance 1e-6) or float32 (1e-3)",
                                                     "choices": tuple(TOLERANCE)})
    device: str = field(default="cpu", metadata={
        "help": "where every rank and the reference run: cpu, or cuda (all ranks on GPU 0, over gloo)",
        "choices": ("cpu", "cuda")})
    sync_batchnorm: bool = field(default=True, metadata={"help": "SyncBN in the distributed run"})
    gather_distributed: bool = field(default=True, metadata={"help": "global-batch losses", "flag": "gather"})
    shared_queue: bool = field(default=True, metadata={"help": "MoCo-style queues shared by all workers"})
    shard: str = field(default="none", metadata={
        "help": "sharding of the distributed run: none (DDP) | optimizer (ZeRO-1) | full (FSDP2); the reference "
                "process is never sharded", "choices": ("none", "optimizer", "full")})
    seed: int = field(default=0, metadata={"range": _as_in_training("seed"), "help": "seed"})
    lr: float | None = field(default=None, metadata={"range": Range(0, lo_open=True),
        "help": "base learning rate per 256 images; default: the method's recipe, as in unison train"})
    data: str | None = field(default=None, metadata={
        "help": f"check on these images instead of synthetic ones ({DATA_LAYOUTS}), streamed (each worker "
                "decodes its slice of every batch in a loader process) at --image-size"})
    grad_sync_every: int = field(default=1, metadata={"range": _as_in_training("grad_sync_every"),
        "help": "micro-batches per optimiser step (as unison train's); the reference takes them in one step when the "
                "backbone has no batch norm, else in as many micro-batches"})
    accumulation: str = field(default="exact", metadata={
        "help": "with --grad-sync-every K > 1: exact | independent (as unison train's)",
        "choices": ("exact", "independent")})
    # ---- continued pre-training: as unison train's
    layer_decay: float | None = field(default=None, metadata={"range": _as_in_training("layer_decay"),
        "help": "per-block learning-rate decay in (0, 1] (as unison train's --layer-decay)"})
    freeze: str | None = field(default=None, metadata={
        "help": "freeze part of the backbone: N blocks, 'all' or module names (as unison train's --freeze)",
        "metavar": "SPEC"})
    teacher_backbone: str | None = field(default=None, metadata={
        "help": "--method distill: the architecture of its seeded random-init teacher (default small_cnn): the check "
                "proves the student's gradient exact, whatever the teacher's weights"})
    method_params: dict[str, Any] = field(default_factory=dict)


# (bound at step 1, bound at every step) on the relative loss difference of 1 vs W workers: float64 stays at
# rounding level for the whole run, so one tight bound holds at every step; float32 agrees to rounding level at
# step 1 and then drifts by up to a few 1e-2 (`unison.equivalence.curves` says why), so its every-step bound is loose.
CURVE_TOLERANCE = {"float64": (1e-8, 1e-8), "float32": (1e-5, 5e-2)}


@dataclass
class CurveSpec:
    """Options of ``unison check --run`` (the other `CheckSpec` options map onto the runs as noted)."""

    run: bool = field(default=False, metadata={
        "help": "train whole runs instead (`unison train` on digits) at 1 and --world-size workers, same seed and "
                "global batch, and compare the loss curves step by step (float64: 1e-8 at every step; float32: 1e-5 "
                "at step 1, then a 5e-2 drift bound); --steps/--local-batch/--image-size/--lr apply to the step check "
                "only"})
    run_steps: int = field(default=200, metadata={"range": Range(1, MAX_STEPS),
        "help": "optimiser steps of each run (--run); the default takes about 2.5 minutes on 2 CPU cores"})
    run_batch_size: int = field(default=64, metadata={"range": Range(1, MAX_BATCH), "help": "global batch of each run (--run)"})
    run_out: str | None = field(default=None, metadata={
        "help": "keep the run directories (w1/, w2/: metrics.csv, plot.png, ...) here (--run); default: a temporary "
                "directory", "metavar": "DIR"})
