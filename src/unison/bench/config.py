"""`BenchConfig`: the one set of benchmark defaults, as two presets, plus machine and load facts.

Presets (`PRESETS`): ``cpu`` is the dataclass default and fits a 2-core machine (small CNN,
a class-balanced CIFAR-10 subset, 2 gloo workers of 1 thread each, SimCLR and MoCo);
``gpu`` is Lightly's distributed-table protocol (ResNet-18, CIFAR-10, global batch 512,
kNN k=200, 4 NCCL workers, 100 epochs by default). Command-line flags override the chosen
preset field by field, so ``unison bench table --preset gpu --epochs 200`` is the 200-epoch table.

Why the CPU rows pin one thread per worker: a worker stands for one device, as a GPU does
in Lightly's table, so "1 worker" gets one core and "2 workers" get two.

Load: the machine is shared, so every measurement records ``/proc/loadavg`` just before it
starts; with ``--max-load X`` the benchmark first waits until the 1-minute load is at most X,
for at most ``--load-wait-s`` in the whole run (then it measures anyway; the load is in the
tables either way).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.config.fields import shown
from unison.errors import ConfigError

PARTS = ("table", "comm", "lightly", "scaling", "data", "race", "all")   # lightly, race: the lab's (`unison.bench.lab`)
NOT_IN_ALL = ("all", "race")   # `bench all` runs the others; the race (two budgets of 15 minutes) is its own
SEED_METHODS = ("simclr", "moco", "simsiam", "barlowtwins", "byol", "swav")   # Lightly's distributed table
# src/unison/bench/config.py -> the repository root (relative data paths are tried from there too)
REPO_ROOT = Path(__file__).resolve().parents[3]
SHARED_CIFAR10 = "../shared/data/cifar10"


@dataclass
class BenchConfig:
    preset: str = field(default="cpu", metadata={
        "help": "cpu: small_cnn, CIFAR-10 subset, 2 gloo workers x 1 thread, simclr+moco; gpu: Lightly's protocol "
                "(resnet18, CIFAR-10, batch 512, k=200, 4 NCCL workers, 100 epochs, 6 methods); gpu1: the gpu preset's "
                "Lightly comparison on one GPU; other flags override",
        "choices": ("cpu", "gpu", "gpu1")})
    methods: str = field(default="simclr,moco", metadata={
        "help": "comma-separated methods for the table and comm report; 'seed': the six of Lightly's table (simclr, "
                "moco, simsiam, barlowtwins, byol, swav)"})
    backbone: str = field(default="small_cnn", metadata={"help": "backbone of every run (same module type on both "
                                                                 "sides of the Lightly comparison)"})
    data: str = field(default=f"{SHARED_CIFAR10}/train", metadata={
        "help": "training images (ImageFolder, 'cifar10' or 'digits'); relative paths are also tried from the repo root"})
    val: str | None = field(default=f"{SHARED_CIFAR10}/val", metadata={"help": "held-out images for kNN"})
    subset: int | None = field(default=5000, metadata={"help": "class-balanced subset of the training images"})
    val_subset: int | None = field(default=1000, metadata={"help": "class-balanced subset of the held-out images"})
    epochs: int = field(default=2, metadata={"help": "epochs per table run"})
    batch_size: int = field(default=256, metadata={"help": "GLOBAL batch size, the same for every configuration"})
    workers: int = field(default=2, metadata={"help": "W, the number of workers of the multi-worker rows"})
    threads: int | None = field(default=1, metadata={"help": "torch threads per worker (unset: cores / workers)"})
    backend: str = field(default="auto", metadata={"help": "process-group backend of the multi-worker runs",
                                                   "choices": ("auto", "gloo", "nccl")})
    knn_k: int = field(default=200, metadata={"help": "kNN neighbours (Lightly's protocol: 200)"})
    seed: int = field(default=0, metadata={"help": "seed of every run"})
    comm_steps: int = field(default=4, metadata={
        "help": "steps per comm-report configuration (PowerSGD compresses from step 3 on; steps 3+ are reported)"})
    scaling_steps: int = field(default=30, metadata={"help": "optimiser steps of each scaling run"})
    data_folder: str | None = field(default=None, metadata={
        "help": "bench data: an ImageFolder of JPEGs (default: ImageNet-like images generated under --out)"})
    data_images: int = field(default=512, metadata={"help": "bench data: number of generated images"})
    data_loader_workers: int = field(default=2, metadata={
        "help": "bench data: DataLoader worker processes, the same on both sides"})
    data_batch_size: int = field(default=64, metadata={"help": "bench data: images per batch"})
    data_batches: int = field(default=10, metadata={"help": "bench data: timed batches per run (after 2 warm-up)"})
    data_repeats: int = field(default=2, metadata={"help": "bench data: runs per side, alternating; the best counts"})
    data_threads: int = field(default=1, metadata={
        "help": "bench data: torch threads of the training process (unison's colour ops run there)"})
    train_args: str = field(default="", metadata={
        "help": "extra 'unison train' flags for every run, e.g. \"--amp bf16 --channels-last\""})
    out: str | None = field(default=None, metadata={"help": "output directory (unset: runs/bench/<preset>)"})
    max_load: float | None = field(default=None, metadata={
        "help": "before each measurement wait until the 1-minute load average is at most this"})
    load_wait_s: float = field(default=900.0, metadata={
        "help": "the most this run waits for --max-load, all measurements together; then it measures anyway"})
    dry_run: bool = field(default=False, metadata={"help": "print the training commands and exit"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace the results and runs an earlier bench left in --out (without it, they are left as they are "
                "and nothing is run)"})

    def validate(self) -> BenchConfig:
        from unison.methods import METHODS

        for m in self.method_list:
            if m not in METHODS:
                raise ConfigError(f"bench: method {m!r} is unknown; use some of {', '.join(sorted(METHODS))} or 'seed'")
        if not self.method_list:
            raise ConfigError("bench: --methods is empty; give e.g. simclr,moco")
        for name in ("epochs", "batch_size", "workers", "knn_k", "comm_steps", "scaling_steps",
                     "data_images", "data_batch_size", "data_batches", "data_repeats", "data_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench: {name}={getattr(self, name)} must be >= 1")
        if self.workers < 2:
            raise ConfigError("bench: --workers must be >= 2 (the table compares 1 worker with W workers)")
        if self.batch_size % self.workers:
            raise ConfigError(f"bench: batch_size={self.batch_size} must be divisible by workers={self.workers}")
        if self.data_loader_workers < 0:
            raise ConfigError(f"bench: data_loader_workers={self.data_loader_workers} must be >= 0")
        if self.comm_steps < 3:
            raise ConfigError("bench: --comm-steps must be >= 3 (PowerSGD compresses from the third step)")
        self.train_words   # noqa: B018 (a command line that does not split is refused here, before any work)
        return self

    @property
    def train_words(self) -> list[str]:
        """--train-args split as a shell splits it: the one reading of them (every run, the Lightly side's --amp)."""
        import shlex

        try:
            return shlex.split(self.train_args)
        except ValueError as exc:   # "No closing quotation", "No escaped character"
            raise ConfigError(f"bench: --train-args {shown(self.train_args)} is not a command line ({exc}); give "
                              "unison train's flags as one quoted string, e.g. --train-args \"--amp bf16 "
                              "--param temperature=0.2\"") from None

    @property
    def method_list(self) -> list[str]:
        return expand_methods(self.methods, {"seed": SEED_METHODS})

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/bench/{self.preset}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def preset_defaults(self) -> BenchConfig:
        """The preset this configuration starts from: what `bench_command` leaves out."""
        return PRESETS[self.preset]


def expand_methods(names: str, groups: dict[str, tuple[str, ...]]) -> list[str]:
    """Comma-separated method names, each name of `groups` (e.g. 'seed': Lightly's table's six) expanded."""
    out: list[str] = []
    for name in (n.strip() for n in names.split(",")):
        for m in groups.get(name, (name,) if name else ()):
            if m not in out:
                out.append(m)
    return out


PRESETS: dict[str, BenchConfig] = {
    "cpu": BenchConfig(),
    # Lightly's distributed table: ResNet-18 (CIFAR stem), CIFAR-10, total batch 512, kNN k=200.
    "gpu": BenchConfig(preset="gpu", methods="simclr,moco,simsiam,barlowtwins,byol,swav", backbone="resnet18",
                       subset=None, val_subset=None, epochs=100, batch_size=512, workers=4, threads=None,
                       backend="nccl", scaling_steps=100),
    # One GPU: the Lightly comparison (same GPU, same work) and the communication report of the gpu preset's
    # configuration; the table and scaling parts need several GPUs and are refused on one.
    "gpu1": BenchConfig(preset="gpu1", methods="simclr,moco,simsiam,barlowtwins,byol,swav", backbone="resnet18",
                        subset=None, val_subset=None, epochs=100, batch_size=512, workers=4, threads=None,
                        backend="nccl", scaling_steps=100),
}


def config_from_overrides(overrides: dict[str, Any], presets: Mapping[str, BenchConfig] | None = None) -> BenchConfig:
    """The preset named in `overrides` (default cpu) of `presets` (default `PRESETS`), then every other given field
    on top."""
    presets = PRESETS if presets is None else presets
    overrides = dict(overrides)
    preset = overrides.pop("preset", "cpu")
    if preset not in presets:
        raise ConfigError(f"bench: preset {preset!r} is unknown; use one of {', '.join(presets)}")
    return dataclasses.replace(presets[preset], **overrides).validate()


def resolve_data(path: str | None) -> str | None:
    """`path` as given if it exists (or is a named dataset), else relative to the repo root, else None."""
    if path is None or path in ("digits", "cifar10"):
        return path
    p = Path(path)
    if p.exists():
        return str(p)
    if not p.is_absolute() and (REPO_ROOT / p).exists():
        return str((REPO_ROOT / p).resolve())
    return None


def data_or_skip(cfg: BenchConfig) -> tuple[str, str | None] | str:
    """(train, val) paths, or a one-line reason to skip when a folder is absent."""
    train = resolve_data(cfg.data)
    val = resolve_data(cfg.val) if cfg.val is not None else None
    missing = [p for p, r in ((cfg.data, train), (cfg.val, val)) if p is not None and r is None]
    if missing:
        tried = "the working directory" + (f" and {REPO_ROOT}" if (REPO_ROOT / "pyproject.toml").exists() else "")
        return (f"data folder(s) {', '.join(missing)} not found (tried {tried}); pass --data/--val: ImageFolder "
                "directories, or --data cifar10 --val cifar10 to download CIFAR-10")
    assert train is not None
    return train, val


# --------------------------------------------------------------------------- machine and load
def loadavg() -> tuple[float, float, float] | None:
    try:
        return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])  # type: ignore[return-value]
    except (OSError, ValueError):
        try:
            return os.getloadavg()
        except OSError:
            return None


def format_load(load: tuple[float, float, float] | None) -> str:
    return "n/a" if load is None else " ".join(f"{x:.2f}" for x in load)


_waited_s = 0.0   # time this process has spent in wait_for_load: --load-wait-s bounds the whole invocation


def wait_for_load(max_load: float | None, wait_s: float, poll_s: float = 60.0) -> tuple[float, float, float] | None:
    """Wait until the 1-minute load is <= max_load; all waits of one run share `wait_s`. Returns the last load."""
    global _waited_s
    load = loadavg()
    if max_load is None or load is None:
        return load
    while load is not None and load[0] > max_load and _waited_s < wait_s:
        nap = min(poll_s, wait_s - _waited_s)
        print(f"unison bench: 1-minute load {load[0]:.2f} > {max_load}; waiting {nap:.0f} s "
              f"({wait_s - _waited_s:.0f} s of waiting left)", flush=True)
        time.sleep(nap)
        _waited_s += nap
        load = loadavg()
    return load


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict[str, Any]:
    import torch

    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 1
    info: dict[str, Any] = {"nproc": nproc, "cpu": cpu_model(), "torch": torch.__version__,
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def describe_machine(info: dict[str, Any]) -> str:
    gpus = f", GPUs: {', '.join(info['gpus'])}" if info.get("gpus") else ", no GPU"
    return f"{info['nproc']} cores (`nproc`), {info['cpu']}{gpus}, torch {info['torch']}, Python {info['python']}"


def bench_command(part: str, cfg: BenchConfig) -> str:
    """The `unison bench` command line that reproduces `cfg`: the preset plus every field that differs from it."""
    import shlex

    base = cfg.preset_defaults()
    args = ["unison", "bench", part, "--preset", cfg.preset]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("preset", "dry_run", "overwrite") or value == getattr(base, f.name) or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif str(value).startswith("-"):   # e.g. --train-args=--no-channels-last: argparse would read a flag
            args.append(f"{flag}={value}")
        else:
            args += [flag, str(value)]
    return shlex.join(args)
