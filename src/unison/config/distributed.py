"""`DistributedConfig`: one object that describes how a run is distributed.

It is a plain dataclass: defaults live here and nowhere else, the CLI flags are
generated from its fields (see `unison.config.fields`), and `validate()` runs before
any process is started so that a bad value is a one-line error, never a hang.

Example::

    cfg = DistributedConfig(backend="gloo", world_size=2, grad_compression="fp16", shard="optimizer")
    cfg.validate()
    DistributedConfig.from_dict(cfg.to_dict()) == cfg   # True
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from unison.config.fields import Range, check_fields, coerce_fields, shown, unknown_keys_message
from unison.errors import ConfigError

BACKENDS = ("auto", "local", "gloo", "nccl", "mpi")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
SHARDING = ("none", "optimizer", "full")
ACCUMULATIONS = ("exact", "independent")   # --accumulation: what --grad-sync-every K > 1 computes
# The longest collective timeout accepted: 2**31 ms (24.8 days), the largest a signed 32-bit count of milliseconds
# holds. torch's C++ timeouts (gloo's, the TCP store's) and timedelta overflow orders of magnitude beyond it, so
# this cap leaves every backend and torch version a wide margin; no real collective waits for weeks.
MAX_TIMEOUT_S = 2**31 / 1000
# The shortest: below a second the rendezvous of even 2 local workers fails with C++ stack frames.
MIN_TIMEOUT_S = 1.0
MAX_WORLD = 2**16   # workers: more than any cluster runs in one job
CPU_WORLD_SIZE = 2  # the default workers without a GPU: the smallest world that shows (and checks) distribution


# Device nodes through which torch reaches a GPU on Linux: NVIDIA's, AMD ROCm's, WSL 2's.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_device_node_found() -> bool:
    """Whether one of `GPU_DEVICE_NODES` exists: a GPU torch could use may be here."""
    return any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def cuda_found() -> bool:
    """Whether torch sees a CUDA device here. Where no GPU device node exists (Linux) it cannot, and torch is not
    imported to ask: the options of ``unison train`` are then checked, and a mistyped one refused, in a fraction
    of a second instead of the seconds torch's import takes."""
    if sys.platform.startswith("linux") and not gpu_device_node_found():
        return False
    import torch

    return torch.cuda.is_available()


def checked_device(device: Any, option: str = "--device") -> Any:
    """`device` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, another torch device name, a ``torch.device``, a CUDA
    index) as the ``torch.device`` to use here (``auto``: cuda where torch sees one, else cpu), or a one-line
    `ConfigError` naming `option` (``--device``, or a keyword such as ``device``): not a device name, or a device
    this machine lacks. The one check of every command and function that is given a device, before it reads
    anything onto it (else torch's error there would read like a fault of the file)."""
    import torch

    given = f"{option} {device}" if option.startswith("--") else f"{option}={device!r}"
    cpu = f"{option} cpu" if option.startswith("--") else f"{option}='cpu'"
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if cuda_found() else "cpu")
    try:
        if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):   # int: a CUDA index
            raise TypeError(type(device).__name__)
        resolved = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{given[:80]} is not a device; give cpu, cuda or cuda:N (or auto)") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        found = torch.cuda.device_count() if cuda_found() else 0
        if not found:
            raise ConfigError(f"{given} but no CUDA device is available; use {cpu}")
        if resolved.index is not None and resolved.index >= found:
            raise ConfigError(f"{given} but this machine has {found} CUDA device{'s' if found > 1 else ''} "
                              f"(cuda:0{f' to cuda:{found - 1}' if found > 1 else ''}); give one of them")
        return resolved
    try:   # another kind (mps, xpu, ...): usable when torch can place a tensor there
        torch.empty(0, device=resolved)
    except Exception as e:   # torch's error for a device it was not built for or cannot reach
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{given} is not available here ({reason}); use {cpu}") from None
    return resolved


def default_world_size() -> int:
    """The default number of workers: one per visible GPU on a CUDA machine (Lightning's ``devices="auto"``; one
    GPU: one worker, as NCCL needs), else `CPU_WORLD_SIZE` CPU workers over gloo."""
    if not cuda_found():
        return CPU_WORLD_SIZE
    import torch

    return torch.cuda.device_count()



@dataclass
class DistributedConfig:
    backend: str = field(
        default="auto",
        metadata={"help": "auto | local (in-memory, 1 process) | gloo | nccl | mpi (launched by mpirun, talks gloo/nccl)",
                  "choices": BACKENDS},
    )
    world_size: int = field(default_factory=default_world_size, metadata={
        "range": Range(1, MAX_WORLD),
        "help": "number of worker processes (1 = single process; default: one per visible GPU on a CUDA machine, "
                f"else {CPU_WORLD_SIZE})"})
    rank: int = field(default=0, metadata={   # its range, [0, world_size), is checked in validate()
        "help": "rank of this process; set by the launcher, torchrun, SLURM or mpirun"})
    sync_batchnorm: bool = field(
        default=True, metadata={"help": "batch norm statistics over the global batch (exact multi-worker equivalence)"})
    gather_distributed: bool = field(
        default=True,
        metadata={"help": "losses see the global batch (negatives, cross-correlation, Sinkhorn) via autograd-correct gathers",
                  "flag": "gather"},
    )
    grad_sync_every: int = field(
        default=1, metadata={
            "range": Range(1, 10**6),
            "help": "accumulate gradients over K micro-batches per optimiser step (--accumulation says how)"})
    accumulation: str = field(
        default="exact", metadata={
            "help": "with --grad-sync-every K > 1: exact (the gradient of one step on all K micro-batches: embeddings "
                    "cached, the loss on all of them, each micro-batch's backbone re-run with its graph; about one "
                    "extra backbone forward) | independent (a loss per micro-batch, gradients summed: cheaper, but "
                    "each micro-batch sees only its own negatives, statistics, codes)",
            "choices": ACCUMULATIONS})
    grad_compression: str = field(
        default="none", metadata={"help": "DDP gradient compression: none | fp16 | bf16 (NCCL only) | powersgd",
                                  "choices": GRAD_COMPRESSIONS})
    powersgd_rank: int = field(default=4, metadata={
        "range": Range(1, 1024),
        "help": "PowerSGD matrix approximation rank"})
    powersgd_start_iter: int = field(
        default=10, metadata={
            "range": Range(2, 10**9, hint=" (PowerSGD with error feedback needs a few uncompressed steps first)"),
            "help": "PowerSGD: plain all-reduce for this many steps before compressing (>1)"})
    find_unused_parameters: bool = field(
        default=False, metadata={"help": "DDP find_unused_parameters (needed only when some parameters get no gradient)"})
    shared_queue: bool = field(
        default=True, metadata={"help": "MoCo-style queues are shared: every rank enqueues the gathered global batch"})
    shard: str = field(
        default="none",
        metadata={"help": "none (DDP: every rank holds everything) | optimizer (DDP + ZeRO-1: optimizer state sharded; "
                          "alias --shard-optimizer) | full (FSDP2: parameters, gradients and optimizer state sharded, "
                          "per backbone block and head; checkpoints via torch.distributed.checkpoint)",
                  "choices": SHARDING})
    reshard_after_forward: bool = field(
        default=True, metadata={"help": "--shard full: free each block's gathered parameters after its forward and "
                                        "gather them again for the backward (less memory, one more all-gather)"})
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute each backbone block's activations in the backward instead of "
                                         "keeping them (blocks without batch norm; less memory, ~1/3 more compute)"})
    master_addr: str = field(default="127.0.0.1", metadata={"help": "rendezvous address (loopback unless given)"})
    master_port: int = field(default=0, metadata={
        "range": Range(0, 65535, interval=True, hint=" (0 = pick a free port)"),
        "help": "rendezvous port (0 = pick a free one)"})
    timeout_s: float = field(
        default=300.0, metadata={
            "range": Range(MIN_TIMEOUT_S, MAX_TIMEOUT_S, hint=" seconds (the rendezvous and every collective must fit in it)",
                           above=f"is past the longest timeout torch takes safely, {int(MAX_TIMEOUT_S)} s (24.8 days); "
                                 "give a smaller --timeout-s"),
            "help": "seconds a collective may wait before the run is ended with an error"})
    watchdog_s: float = field(
        default=180.0, metadata={
            "range": Range(0, MAX_TIMEOUT_S, hint=" seconds (0 = no watchdog)"),
            "help": "end the run when no rank has made progress (data, step, collective, "
                                         "checkpoint) for this many seconds; 0 = off"})

    @property
    def shard_optimizer(self) -> bool:
        """ZeRO-1 (``shard == "optimizer"``); the name of the option before ``shard`` existed."""
        return self.shard == "optimizer"

    # ------------------------------------------------------------------ helpers
    def resolved_backend(self, cuda_available: bool | None = None) -> str:
        """The concrete backend: `auto` becomes local (1 worker), nccl (CUDA) or gloo."""
        if self.backend != "auto":
            return self.backend
        if self.world_size == 1:
            return "local"
        if cuda_available is None:
            cuda_available = cuda_found()
        return "nccl" if cuda_available else "gloo"

    def communication_backend(self, cuda_available: bool | None = None) -> str:
        """The torch.distributed backend used for communication (mpi/local talk over gloo or nccl)."""
        backend = self.resolved_backend(cuda_available)
        if backend in ("gloo", "nccl"):
            return backend
        if backend == "local":
            return "gloo"
        if cuda_available is None:
            cuda_available = cuda_found()
        return "nccl" if cuda_available else "gloo"  # mpi-launched

    def validate(self, cuda_available: bool | None = None) -> DistributedConfig:
        """Raise `ConfigError` with a one-line fix for any invalid combination; return self."""
        check_fields(self, "distributed.")
        if cuda_available is None:
            cuda_available = cuda_found()
        if self.backend not in BACKENDS:
            raise ConfigError(f"distributed.backend={shown(self.backend)} is unknown; use one of {', '.join(BACKENDS)}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"distributed.rank={shown(self.rank)} is outside [0, world_size={self.world_size}); "
                "give a rank from 0 to world_size-1")
        if self.backend == "local" and self.world_size != 1:
            raise ConfigError(
                f"distributed.backend='local' is a single in-memory process but world_size={self.world_size}; "
                "use --world-size 1 or --backend gloo")
        backend = self.resolved_backend(cuda_available)
        if backend == "nccl" and not cuda_available:
            raise ConfigError("distributed.backend='nccl' needs CUDA GPUs and none is available; use --backend gloo")
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise ConfigError(
                f"distributed.grad_compression={shown(self.grad_compression)} is unknown; use one of {', '.join(GRAD_COMPRESSIONS)}")
        comm = self.communication_backend(cuda_available)
        if self.grad_compression == "bf16" and comm != "nccl":
            raise ConfigError(
                f"distributed.grad_compression='bf16' needs CUDA + NCCL but the backend is {comm}; "
                "use --grad-compression fp16 or powersgd")
        self._validate_sharding()
        if self.accumulation not in ACCUMULATIONS:
            raise ConfigError(f"distributed.accumulation={shown(self.accumulation)} is unknown; use one of "
                              f"{', '.join(ACCUMULATIONS)}")
        if not self.master_addr:
            raise ConfigError("distributed.master_addr is empty; give an address or leave the default 127.0.0.1")
        if len(self.master_addr) > 253:
            raise ConfigError(f"distributed.master_addr={shown(self.master_addr)} must be a host name or address "
                              "(at most 253 characters); leave the default 127.0.0.1 for one machine")
        if 0 < self.watchdog_s < MIN_TIMEOUT_S:
            raise ConfigError(f"distributed.watchdog_s={shown(self.watchdog_s)} must be 0 (no watchdog) or at least "
                              f"{MIN_TIMEOUT_S:g} s: workers need seconds to start")
        return self

    def _validate_sharding(self) -> None:
        if self.shard not in SHARDING:
            raise ConfigError(f"distributed.shard={shown(self.shard)} is unknown; use one of {', '.join(SHARDING)}")
        if self.shard != "full":
            return
        if self.grad_compression != "none":
            raise ConfigError(f"distributed.grad_compression={shown(self.grad_compression)} is a DDP communication hook, "
                              "which --shard full (FSDP) does not have; use --grad-compression none or --shard none")
        if self.find_unused_parameters:
            raise ConfigError("distributed.find_unused_parameters is a DDP option; --shard full (FSDP) needs every "
                              "rank to use the same parameters: drop --find-unused-parameters or use --shard none")

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], top_level_names: Collection[str] = ()) -> DistributedConfig:
        """`top_level_names`: the options of the enclosing configuration, named if given here by mistake."""

        known = {f.name for f in dataclasses.fields(cls)}
        data = dict(data)
        if "shard_optimizer" in data:   # configs and checkpoints written before `shard` existed
            legacy = data.pop("shard_optimizer")
            if legacy and data.get("shard", "optimizer") != "optimizer":
                raise ConfigError(f"distributed.shard_optimizer=true contradicts distributed.shard="
                                  f"{shown(data['shard'])}; give only shard")
            if legacy:
                data["shard"] = "optimizer"
        unknown = sorted(set(data) - known, key=shown)
        if unknown:
            top = [k for k in unknown if k in top_level_names]
            if top:
                raise ConfigError(f"option(s) {', '.join(top)} belong at the top level of a config file, "
                                  "not under 'distributed:'")
            raise ConfigError(unknown_keys_message(unknown, known, "distributed option"))
        return cls(**coerce_fields(cls, data))


def as_distributed(value: Any, top_level_names: Collection[str] = ()) -> DistributedConfig:
    """`TrainConfig.distributed` as a `DistributedConfig`: a mapping converted as a config file's ``distributed:`` is
    (`DistributedConfig.from_dict`), anything else refused in one line (it is read before the fields are checked)."""
    if isinstance(value, dict):
        return DistributedConfig.from_dict(value, top_level_names)
    if not isinstance(value, DistributedConfig):
        raise ConfigError(f"distributed={shown(value)} must be a DistributedConfig (in a file: a mapping)")
    return value
