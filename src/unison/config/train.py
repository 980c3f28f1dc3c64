"""`TrainConfig`: everything a training run needs, with the one set of defaults.

The defaults are the main job: SimCLR on the embedded digits data, 2 gloo workers, a
small CNN, kNN evaluation on the held-out split. ``to_dict``/``from_dict`` round-trip
through plain JSON/YAML; unknown keys are an error that names the known ones. Values
left at ``None`` (optimizer, lr, weight decay, augmentation) take the method's recipe.

Example::

    cfg = TrainConfig(method="moco", epochs=10, distributed=DistributedConfig(world_size=4))
    cfg.validate()
    TrainConfig.from_dict(cfg.to_dict()) == cfg
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from unison.config.budget import check_plan, duration_with_units, parse_duration
from unison.config.distributed import DistributedConfig, as_distributed, cuda_found
from unison.config.extras import install_command
from unison.config.fields import Range, ascii_digits, check_fields, coerce_fields, shown, unknown_keys_message
from unison.config.limits import KNN_REFERENCE, MAX_IMAGE_SIZE, MAX_LOCAL_CROPS, MIN_IMAGE_SIZE
from unison.config.presets import PRESETS, with_preset
from unison.errors import ConfigError

# Every layout a data option reads, for the help of every command that takes images (one wording, one place)
DATA_LAYOUTS = ("an ImageFolder directory, a folder of images (unlabelled), a file list (one path per line, optional "
                "label), .tar shards (x.tar, a folder of them, or train-{0000..0146}.tar) or a pack (x.pack, written "
                "by unison.data.pack.write_pack)")

AMP_MODES = ("none", "bf16", "fp16")
ON_CORRUPT = ("skip", "error")
DATA_MODES = ("auto", "memory", "stream")
DECODERS = ("cpu", "gpu")
LOGGERS = ("none", "csv", "tensorboard", "wandb", "mlflow")
# the package each --logger needs beyond unison's own (csv and none: nothing)
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
OPTIMIZERS = ("sgd", "lars", "adam", "adamw")
TEACHER_DTYPES = ("float32", "bf16")
MAX_EPOCHS = 10**9       # epochs and warm-up epochs: any real run is far below; past it, step counts overflow
MAX_SEED = 2**64 - 1     # torch.manual_seed takes unsigned 64-bit seeds
MAX_STEPS = 2**62        # optimiser steps: a step counter in int64 never overflows
MAX_BATCH = 2**24        # a global batch of 16M images: far past any recipe, far below an index overflow
MIN_KNN_T = 0.02         # kNN temperature: similarities are <= 1 and exp(1 / t) must stay finite in float32 (e**88.7)
MAX_IMAGES = 2**40       # subsets: more images than any data set
MAX_SIGNAL_IMAGES = 4096  # the signals' pairwise distances: N**2 / 2 float64 values (64 MiB at 4096)
# fewest held-back images that can tell a collapse: RankMe of N images is at most N, so with fewer images a healthy
# encoder's RankMe lies too near the collapse floor of 2 to be told from a collapsed one; one image has embedding
# std 0
MIN_COLLAPSE_IMAGES = 16

MAX_CADENCE_S = 10**7   # about 4 months: past any run


@dataclass(frozen=True)
class Cadence:
    """When ``--checkpoint-every`` saves: every `steps` optimiser steps, or every `seconds` (one of them is set;
    both 0: at the end of every epoch). `value`: the option as the config keeps it (an int, or ``"10m"``)."""

    steps: int = 0
    seconds: float = 0.0
    value: int | str = 0


def checkpoint_cadence(value: Any) -> Cadence:
    """The one parser of ``--checkpoint-every``: a step count (``50``, ``"50"``) or a duration with units (``"30s"``,
    ``"10m"``, ``"1h30m"``: ``--time-budget``'s grammar). Raises `ConfigError` (one line) for anything else."""
    text = str(value).strip().lower() if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    seconds = duration_with_units(text) if text else None   # the one grammar of durations (--time-budget's)
    if seconds is not None and 0 < seconds <= MAX_CADENCE_S:
        return Cadence(seconds=seconds, value=text or "")
    if text is not None and ascii_digits(text.removeprefix("-")) and len(text) < 20 and 0 <= int(text) <= MAX_STEPS:
        return Cadence(steps=int(text), value=int(text))
    given = text if text is not None and len(text) <= 40 and text.isprintable() else shown(value)
    raise ConfigError(f"checkpoint_every={given} must be an integer >= 0 and <= 2**62 (steps; 0 = at the "
                      f"end of every epoch) or a duration such as 30s, 10m, 2h or 1h30m (at most "
                      f"{MAX_CADENCE_S // 86400} days)")


@dataclass
class TrainConfig:
    preset: str | None = field(default=None, metadata={
        "help": "a recipe for the options not given: speedrun (the best encoder a fixed time buys on CIFAR-sized "
                "data: SimCLR, data resident on the device, --time-budget 5m; ResNet-18 in bf16 on a GPU, the small "
                "CNN compiled on a CPU)",
        "choices": PRESETS})
    method: str = field(default="simclr", metadata={"help": "self-supervised method (the list below)"})
    data: str = field(default="digits", metadata={
        "help": f"training data: 'digits' (embedded), 'cifar10' (torchvision download), {DATA_LAYOUTS}"})
    val: str | None = field(default=None, metadata={
        "help": "labelled held-out data for kNN, in any --data layout; default: the held-out split of digits / "
                "cifar10, and no kNN for other data"})
    subset: int | None = field(default=None, metadata={
        "range": Range(1, MAX_IMAGES),
        "help": "use a class-balanced subset of N training images"})
    val_subset: int | None = field(default=None, metadata={
        "range": Range(1, MAX_IMAGES),
        "help": "use a class-balanced subset of N held-out images"})
    knn_reference: int = field(default=KNN_REFERENCE, metadata={
        "range": Range(0, MAX_IMAGES, hint=" (0 = every training image)"),
        "help": "training images in the kNN reference set, class-balanced; 0: all of them, the protocol of "
                "published kNN figures (Lightly's, solo-learn's): a larger set scores higher and costs more"})
    on_corrupt: str = field(default="skip", metadata={"help": "corrupt image files: skip (with a count) or error",
                                                       "choices": ON_CORRUPT})
    data_mode: str = field(default="auto", metadata={
        "help": "memory: decode all images once into memory (fastest; 3*H*W bytes per image on every worker); "
                "stream: each worker decodes its share of every batch in loader processes (memory independent of "
                "the data's size); auto: memory when the decoded training set fits 2 GiB, else stream",
        "choices": DATA_MODES})
    loader_workers: int | None = field(default=None, metadata={
        "range": Range(0, 256, hint=" (0: decode in the worker itself)"),
        "help": "loader processes per worker for streamed data (0: decode in the worker); default: the cores per "
                "worker minus one, 1 to 8"})
    decode: str = field(default="cpu", metadata={
        "help": "where streamed JPEGs are decoded: cpu (loader processes, DCT-scaled) or gpu "
                "(torchvision.io.decode_jpeg batched on the worker's GPU; needs CUDA)", "choices": DECODERS})
    backbone: str | None = field(default=None, metadata={
        "help": "small_cnn | resnet18 | resnet50 (stem by image size; _cifar / _imagenet pin it) | "
                "vit_<micro|nano|tiny|small|base>[_p8|_p4|_p2|_auto] (_auto: patches from the image size) | timm:<name>; "
                "default: the method's recipe (small_cnn; vit_tiny_auto for mae, ibot, ijepa, lejepa, mocov3, msn, pmsn, "
                "simmim, aim, capi, dinov2, dinov3)"})
    backbone_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "settings of a timm backbone (--backbone-arg NAME=VALUE), e.g. drop_path_rate=0.1, patch_size=4"})
    # ---- continued pre-training: start from weights on disk, per-block lr, frozen blocks
    init: str | None = field(default=None, metadata={
        "metavar": "PATH",
        "help": "start the backbone from these weights: a torchvision/timm state dict (.pt/.pth/.safetensors), a "
                "unison export, or a unison run directory or checkpoint (its backbone); classifier heads (fc.*, "
                "head.*) are skipped; a resumed run takes its weights from the checkpoint, not from here"})
    layer_decay: float | None = field(default=None, metadata={
        "range": Range(0, 1, lo_open=True, interval=True, hint=" (0.65 to 0.75 in MAE/BEiT fine-tuning; 1: none)"),
        "help": "per-block learning-rate decay: block i of D gets lr * decay**(D + 1 - i), the patch/position "
                "embeddings (or a ResNet's stem) decay**(D + 1), the final norm and the heads the full lr"})
    freeze: str | None = field(default=None, metadata={
        "metavar": "SPEC",
        "help": "freeze part of the backbone: N (the embeddings/stem and the first N blocks or stages), 'all', or "
                "module names (patch_embed,blocks.0,layer1), comma-separated"})
    image_size: int | None = field(default=None, metadata={
        "range": Range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hint=" pixels (or left unset: the data's size)"),
        "help": "training crop size; default: the data's shorter side (its first image's), at most 224"})
    local_crops: int | None = field(default=None, metadata={
        "range": Range(0, MAX_LOCAL_CROPS),
        "help": "multi-crop methods (dino, ibot, dinov2, dinov3, swav, lejepa): number of local crops besides the 2 "
                "global ones; default: the augmentation's (4; 8 for dinov2, dinov3); none for swav and dino at 32 px "
                "and below, lejepa at 16"})
    local_crop_size: int | None = field(default=None, metadata={
        "range": Range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hint=" pixels"),
        "help": "multi-crop methods: side of the local crops; default: 3/7 of the image size (96 for 224, 14 for "
                "32), at least 8; with a ViT, the nearest multiple of its patch size (12 for 32 px, 4 px patches)"})
    epochs: int = field(default=30, metadata={
        "range": Range(1, MAX_EPOCHS, above="is past 1e9; to run by steps, give --max-steps (e.g. --epochs 1e9 --max-steps 100000)"),
        "help": "training epochs"})
    batch_size: int = field(default=256, metadata={
        "range": Range(1, MAX_BATCH, hint=" (the global batch, in images)"),
        "help": "GLOBAL batch size (split evenly over workers)"})
    optimizer: str | None = field(default=None, metadata={"help": "sgd | lars | adam | adamw; default: method recipe"})
    lr: float | None = field(default=None, metadata={"range": Range(0),
        "help": "base learning rate per 256 images, scaled linearly with the global batch; default: method recipe"})
    weight_decay: float | None = field(default=None, metadata={
        "range": Range(0),
        "help": "weight decay; default: method recipe"})
    momentum: float = field(default=0.9, metadata={
        "range": Range(0, 1, hi_open=True, interval=True, hint=" (SGD/LARS momentum; 0 = none)"),
        "help": "SGD/LARS momentum"})
    warmup_epochs: float = field(default=2.0, metadata={
        "range": Range(0, MAX_EPOCHS, above="is past 1e9 epochs; a warm-up longer than the run is cut at its end, so "
                                            "give at most the run's --epochs"),
        "help": "linear learning-rate warm-up, then cosine decay"})
    final_lr_ratio: float = field(default=0.0, metadata={"range": Range(0, 1, hi_open=True, interval=True),
        "help": "where the cosine ends, as a share of the peak learning rate (0: at zero)"})
    grad_clip: float | None = field(default=None, metadata={
        "range": Range(0, lo_open=True, hint="; omit --grad-clip for no clipping"),
        "help": "clip the global gradient norm to this value"})
    augmentation: str | None = field(default=None, metadata={
        "help": "augmentation preset (the list below); default: method recipe"})
    seed: int = field(default=0, metadata={
        "range": Range(0, MAX_SEED, interval=True, hint=" (torch's seeds are unsigned 64-bit: 2**64-1 at most)"),
        "help": "seed for initialisation, data order and augmentation"})
    out: str = field(default="runs/default", metadata={"help": "run directory (config, checkpoints, metrics, plot)"})
    resume: str | None = field(default=None, metadata={"help": "resume from this run directory or checkpoint file"})
    checkpoint_every: int | str = field(default=0, metadata={
        "help": "save a checkpoint every N optimiser steps (50), or every so much time (30s, 10m, 2h; rank 0's clock "
                "decides for all ranks); 0 = at the end of every epoch"})
    keep_checkpoints: int = field(default=3, metadata={
        "range": Range(1, 10**6),
        "help": "keep the newest K checkpoints"})
    checkpoint_async: bool = field(default=True, metadata={
        "help": "write checkpoints in a background thread: the step loop waits only for a copy of the state"})
    eval_every: int = field(default=0, metadata={
        "range": Range(0, MAX_EPOCHS, hint=" (0 = only at the end)"),
        "help": "kNN evaluation every N epochs (0 = only at the end)"})
    knn_k: int = field(default=200, metadata={
        "range": Range(1, 10**6),
        "help": "kNN neighbours (Lightly's benchmark protocol: 200)"})
    knn_t: float = field(default=0.1, metadata={
        "range": Range(MIN_KNN_T, 1e6, hint=" (below it the kNN weights exp(similarity / t) overflow)"),
        "help": "kNN temperature for similarity weighting"})
    knn: bool = field(default=True, metadata={
        "help": "kNN evaluation of the encoder on held-out data, at --eval-every and at the end (--no-knn skips it "
                "and the random-init baseline: a smoke run's minutes are otherwise mostly evaluation)"})
    random_init_knn: bool = field(default=True, metadata={
        "help": "before training, measure the kNN accuracy of the randomly initialised encoder (the baseline of the "
                "result line; --no-random-init-knn skips it)"})
    signals_every: int = field(default=0, metadata={
        "range": Range(0, MAX_STEPS, hint=" (0 = every max(50, steps / 50) steps)"),
        "help": "measure the label-free quality signals (RankMe, embedding std, alignment, uniformity) every N "
                "optimiser steps, and at the start and end (0 = every max(50, steps / 50) steps)"})
    signal_images: int = field(default=512, metadata={
        "range": Range(0, MAX_SIGNAL_IMAGES, hint=" (0 = no signals)"),
        "help": "held-back training images the signals are measured on (chosen from --seed; 0 = no signals)"})
    stop_on_collapse: bool = field(default=False, metadata={
        "help": "end the run (final checkpoint and summary kept) when the signals say the representation collapsed "
                f"(judged on --signal-images {MIN_COLLAPSE_IMAGES} or more); without it the run only warns"})
    online_probe: bool = field(default=True, metadata={
        "help": "with labelled training data: train a linear classifier on the detached features of each batch's "
                "first view beside the encoder (never changing its training) and log its accuracy"})
    precision: str = field(default="float32", metadata={
        "help": "parameter/compute dtype: float32, or float64 for exactness and resume checks",
        "choices": ("float32", "float64")})
    amp: str = field(default="none", metadata={
        "help": "mixed precision (autocast): none | bf16 (GPU or CPU) | fp16 (GPU only: with a gradient scaler; "
                "refused on a machine without CUDA)", "choices": AMP_MODES})
    channels_last: bool = field(default=True, metadata={
        "help": "channels_last (NHWC) memory format for conv backbones: oneDNN on CPU and tensor cores on GPU are faster "
                "with it (the CPU SimCLR step about 1.3x); float32 and bf16 only: float64 stays NCHW"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the method"})
    deterministic: bool = field(default=False, metadata={"help": "deterministic algorithms (bitwise repeatable runs)"})
    profile_steps: int = field(default=0, metadata={
        "range": Range(0, MAX_STEPS, hint=" (0 = off)"),
        "help": "record N optimiser steps after the first 10 with torch.profiler into <out>/profile: each rank's "
                "Chrome trace and operator table, and how busy the device was (0 = off; recorded steps run slower)"})
    threads: int | None = field(default=None, metadata={
        "range": Range(1, 4096), "help": "torch threads per worker; default: cores / workers"})
    max_steps: int | None = field(default=None, metadata={
        "range": Range(1, MAX_STEPS), "help": "stop after this many optimiser steps (testing)"})
    time_budget: str | None = field(default=None, metadata={
        "metavar": "DURATION",
        "help": "train for this wall-clock time (90s, 10m, 2h, 1h30m): the run measures its steady step time, then "
                "plans the warm-up and every schedule for the steps that fit, leaving time for the final kNN and "
                "checkpoint, and stops on time; --epochs is not used, --max-steps caps the plan. The step count "
                "depends on the machine: runs that must repeat exactly give --max-steps instead"})
    time_budget_plan: dict[str, Any] | None = field(default=None, metadata={
        "help": "written by a --time-budget run (steps, warm-up, the measured costs): a resumed run keeps it"})
    log_every: int = field(default=10, metadata={
        "range": Range(1, MAX_STEPS), "help": "log metrics every N optimiser steps"})
    progress: bool = field(default=True, metadata={"help": "progress bar on rank 0"})
    logger: str = field(default="csv", metadata={
        "help": "metrics logger: csv (metrics.csv + plot.png), tensorboard (also <out>/tensorboard; pip install "
                "tensorboard), wandb (also Weights & Biases; pip install wandb; WANDB_PROJECT names the project), "
                "mlflow (also an MLflow run: in the server MLFLOW_TRACKING_URI names, else in <out>/mlflow; "
                "pip install mlflow-skinny sqlalchemy alembic), none (no metrics files)", "choices": LOGGERS})
    method_params: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "method hyper-parameters (--param NAME=VALUE)"})
    # ---- distill: the frozen teacher
    teacher: str | None = field(default=None, metadata={
        "help": "--method distill: the frozen teacher: a unison run directory or checkpoint, a weights file "
                "(.pth/.pt/.safetensors of torchvision or timm, a unison export) with --teacher-backbone, or "
                "'random' (a seeded random-init teacher: tests and unison check)"})
    teacher_backbone: str | None = field(default=None, metadata={
        "help": "--method distill: the teacher's architecture (names as --backbone); default: the teacher run's, "
                "or small_cnn for --teacher random"})
    teacher_dtype: str = field(default="float32", metadata={
        "help": "--method distill: the teacher's parameter dtype: float32, or bf16 (half the memory; its "
                "forward in bf16)", "choices": TEACHER_DTYPES})
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:   # ``distributed={"world_size": 2}``: taken as a config file's mapping is
        self.distributed = as_distributed(self.distributed, {f.name for f in dataclasses.fields(self)})

    def validate(self, cuda_available: bool | None = None) -> TrainConfig:
        """Raise `ConfigError` with a one-line fix for any invalid field; return self. The names that only the layers
        above know (method, its parameters, backbone, augmentation) are checked by
        `unison.training.resolve.validate_run`, which calls this first.

        Numbers written as strings (``lr: 1e-3`` in YAML, ``--param momentum_base=1e-2``) become floats, and
        integral numbers in any notation (``1e9``) become ints where the option is an integer.

        A configuration is checked once: validating it again, unchanged, does nothing (the CLI checks the fields
        before torch is imported, and the run's resolution would check them a second time)."""
        checked = _VALIDATED.get(id(self))
        if checked is not None and checked[0]() is self:
            digest = self._digest()
            if digest is not None and checked[1:] == (digest, cuda_available):
                return self
        self.checkpoint_every = checkpoint_cadence(self.checkpoint_every).value   # "50" -> 50, "10m" -> "10m"
        if isinstance(self.time_budget, (int, float)) and not isinstance(self.time_budget, bool):
            self.time_budget = str(self.time_budget)   # `time_budget: 600` in YAML: seconds, as --time-budget 600
        check_fields(self)
        self.distributed = as_distributed(self.distributed)   # a value assigned since
        self.distributed.validate(cuda_available)
        w = self.distributed.world_size
        if self.batch_size % w:
            raise ConfigError(f"batch_size={self.batch_size} (global) cannot be split evenly over world_size={w}; "
                              f"use a multiple of {w}, e.g. {max(w, self.batch_size // w * w)}")
        if not self.out:   # Path("") is the current folder: the run's files would land among the user's own
            raise ConfigError("--out is empty; give a run directory, e.g. --out runs/x")
        if "\x00" in self.out:   # no file name holds one (os.mkdir raises ValueError)
            raise ConfigError(f"--out {shown(self.out)} is not a path (a NUL character); give a run directory")
        if self.init is not None and (not self.init or "\x00" in self.init or len(self.init) > 4096):
            raise ConfigError(f"--init {shown(self.init)} is not a path; give a weights file or a run directory")
        if self.lr == 0:
            raise ConfigError("lr=0 would not train; give a positive learning rate")
        if self.amp not in AMP_MODES:
            raise ConfigError(f"amp={shown(self.amp)} is unknown; use one of {', '.join(AMP_MODES)}")
        if self.amp == "fp16" and not _cuda(cuda_available):   # CPU autocast in fp16 + CUDA's scaler: not run
            raise ConfigError("amp='fp16' is for CUDA GPUs and this machine has none; use --amp bf16 (CPU autocast) "
                              "or --amp none")
        if self.distributed.shard == "full" and self.amp == "fp16":
            raise ConfigError("amp='fp16' needs a gradient scaler for sharded gradients, which --shard full does not "
                              "have; use --amp bf16 (FSDP mixed precision: bf16 parameters, fp32 reduction)")
        if self.distributed.shard == "full" and self.method == "moco" and self.method_params.get("shuffle_bn"):
            raise ConfigError("MoCo shuffle_bn swaps the key encoder's batch-norm layers during training, which "
                              "--shard full cannot follow; use --shard none or drop --param shuffle_bn=true")
        if self.precision not in ("float32", "float64"):
            raise ConfigError(f"precision={shown(self.precision)} is unknown; use float32 or float64")
        if self.on_corrupt not in ON_CORRUPT:
            raise ConfigError(f"on_corrupt={shown(self.on_corrupt)} is unknown; use skip or error")
        self._validate_data(cuda_available)
        self._validate_signals()
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        check_plan(self.time_budget_plan, self.time_budget)
        self._validate_choices()
        self._validate_teacher()
        key = id(self)

        def forget(_: weakref.ref) -> None:
            _VALIDATED.pop(key, None)

        _VALIDATED[key] = (weakref.ref(self, forget), self._digest(), cuda_available)
        return self

    def _digest(self) -> str | None:
        """The configuration's values as one string (what `validate` remembers having checked); None for values too
        large to be a configuration that passed (a list of millions, an alias-expanded tree): never walked in full."""
        budget = [10_000]

        def small(x: Any) -> bool:
            budget[0] -= 1
            if budget[0] < 0:
                return False
            if isinstance(x, dict):
                return all(small(k) and small(v) for k, v in x.items())
            if isinstance(x, (list, tuple)):
                return all(small(v) for v in x)
            if isinstance(x, int):
                return abs(x) < 10**100
            return not isinstance(x, str) or len(x) < 10_000

        if not all(small(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "distributed"):
            return None
        return json.dumps(self.to_dict(), sort_keys=True, default=repr)

    def _validate_signals(self) -> None:
        if not self.stop_on_collapse or self.signal_images >= MIN_COLLAPSE_IMAGES:
            return
        if self.signal_images == 0:
            raise ConfigError("--stop-on-collapse watches the signals and --signal-images 0 turns them off; give "
                              f"--signal-images {MIN_COLLAPSE_IMAGES} or more (default 512), or leave "
                              "--stop-on-collapse out")
        raise ConfigError(f"--stop-on-collapse cannot judge collapse on --signal-images {self.signal_images}: the "
                          f"RankMe of so few images stays below its floor of 2 even for a healthy network, so every "
                          f"run would stop; give --signal-images {MIN_COLLAPSE_IMAGES} or more (default 512)")

    def _validate_teacher(self) -> None:
        """The teacher options' own values; the file and the architecture are checked by
        `unison.training.teacher.validate_teacher` (which knows the methods and backbones)."""
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ConfigError(f"teacher_dtype={shown(self.teacher_dtype)} is unknown; use float32 or bf16")
        if self.teacher is not None and (not self.teacher or "\x00" in self.teacher):
            raise ConfigError(f"--teacher {shown(self.teacher)} is not a path; give a run directory, a weights file "
                              "or 'random'")

    def _validate_choices(self) -> None:
        """The options whose choices this layer knows; methods, backbones and augmentation presets are the layers
        above's, checked by `unison.training.resolve.validate_run`."""
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={shown(self.optimizer)} is unknown; use sgd, lars, adam or adamw")
        if self.logger not in LOGGERS:
            raise ConfigError(f"logger={shown(self.logger)} is unknown; use one of {', '.join(LOGGERS)}")
        check_logger_packages(self.logger)

    def _validate_data(self, cuda_available: bool | None) -> None:
        if self.data_mode not in DATA_MODES:
            raise ConfigError(f"data_mode={shown(self.data_mode)} is unknown; use auto, memory or stream")
        if self.decode not in DECODERS:
            raise ConfigError(f"decode={shown(self.decode)} is unknown; use cpu or gpu")
        if self.decode == "gpu":
            if not _cuda(cuda_available):
                raise ConfigError("--decode gpu decodes JPEGs on the GPU and this machine has no CUDA device; "
                                  "use --decode cpu")
            if self.data_mode == "memory":
                raise ConfigError("--decode gpu decodes streamed batches; use --data-mode stream (or auto)")

    @property
    def nhwc(self) -> bool:
        """Whether conv backbones and their inputs use channels_last: float64 never does (no NHWC kernel for it on
        the CPU or the GPU: the CPU falls back to a conversion around the slow convolution, many times slower than
        NCHW), so `--precision float64` runs, `unison check` among them, keep NCHW whatever --channels-last says."""
        return self.channels_last and self.precision != "float64"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], cuda_available: bool | None = None) -> TrainConfig:
        """`data` as a configuration; a ``preset`` fills the rest as for a machine with CUDA or without (None: this)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a configuration must be a mapping of option names to values, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=shown)
        dist_names = {f.name for f in dataclasses.fields(DistributedConfig)}
        misplaced = [k for k in unknown if k in dist_names]
        if misplaced:
            example = ", ".join(f"{k}: {shown(data[k])}" for k in misplaced)
            raise ConfigError(f"option(s) {', '.join(misplaced)} belong under 'distributed:' in a config file "
                              f"(distributed: {{{example}}}); on the command line: "
                              f"{' '.join('--' + k.replace('_', '-') for k in misplaced)}")
        if unknown:
            raise ConfigError(unknown_keys_message(unknown, known))
        # a complete configuration (a run's config.json, a worker's payload) was filled, and warned about, before
        data = coerce_fields(cls, with_preset(data, _cuda(cuda_available), say=not known <= set(data))
                             if data.get("preset") else data)
        dist = data.pop("distributed", None) or {}
        if not isinstance(dist, dict):
            raise ConfigError("'distributed' must be a mapping of distributed options")
        return cls(**data, distributed=dist)  # type: ignore[arg-type]  # converted by __post_init__


def check_logger_packages(logger: str) -> None:
    """`ConfigError` naming the install command when ``--logger`` `logger` lacks a package it needs: before any worker
    starts, not an ImportError on rank 0 after the model was built. MLflow's client alone (mlflow-skinny) logs to a
    tracking server; the run's own SQLite store (no ``MLFLOW_TRACKING_URI``) also needs its SQL packages."""
    package = LOGGER_PACKAGES.get(logger)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--logger {logger} needs the {package} package: {install_command(package)} "
                          "(or use --logger csv)")
    local_store = logger == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI")
    lacking = [p for p in ("sqlalchemy", "alembic") if local_store and importlib.util.find_spec(p) is None]
    if lacking:
        raise ConfigError(f"--logger mlflow keeps the run in a SQLite store under --out, which needs "
                          f"{' and '.join(lacking)}: {install_command('mlflow')} (or name a tracking server: "
                          "MLFLOW_TRACKING_URI=http://HOST:5000)")


# id -> (the configuration, its values when `TrainConfig.validate` passed, the CUDA answer it was checked for); kept
# beside the object, not on it, so that copies of its attributes (``TrainConfig(**cfg.__dict__)``) stay plain
_VALIDATED: dict[int, tuple[weakref.ref, str | None, bool | None]] = {}


def _cuda(cuda_available: bool | None) -> bool:
    """`cuda_available` as given (tests), else whether this machine has a CUDA device (the workers' device)."""
    return cuda_found() if cuda_available is None else cuda_available
