"""`EvalOptions`: the options of ``unison eval`` and the keywords of ``unison.evaluate`` (one dataclass: the CLI
flags are generated from its fields, `unison.config.fields`), and the checks they get before anything is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from unison.config import TrainConfig
from unison.config.distributed import checked_device
from unison.config.fields import Range, check_fields
from unison.config.train import DATA_LAYOUTS, MAX_BATCH, MAX_EPOCHS
from unison.errors import ConfigError
from unison.paths import OVERWRITE_HELP

DEVICES = ("auto", "cpu", "cuda")
LINEAR_PROTOCOLS = ("fast", "standard", "both")
_TRAIN_RANGES = {f.name: f.metadata["range"] for f in dataclasses.fields(TrainConfig) if "range" in f.metadata}
_RECIPE = "fine-tuning and the standard linear protocol: "   # the help of the options their recipe takes


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
        "help": "class-balanced subset of N held-out images; default: the run's when --val is the run's (kNN and the "
                "fast probe: at most 2,000), all of --val for the fine-tuning and the standard linear protocol"})
    labels: str = field(default="all", metadata={"metavar": "N|P%|all",
        "help": "labelled training images the probes and the fine-tuning learn from: N images or a share P%% of --data (10%%), a "
                "class-balanced subset drawn with --seed (kNN: its reference set); all: every one"})
    knn: bool = field(default=True, metadata={"help": "weighted kNN top-1"})
    linear: bool = field(default=True, metadata={"help": "linear probe top-1 on frozen features"})
    linear_protocol: str = field(default="fast", metadata={"choices": LINEAR_PROTOCOLS,
        "help": "fast: 100 epochs of Adam on the un-augmented features of at most 5,000 training images, scored on "
                "2,000 held-out ones (seconds); standard: the protocol of published numbers, a linear classifier "
                "on the frozen backbone, trained on augmented views of every labelled image by SGD, top-1 and "
                "top-5 on all of --val; both"})
    fine_tune: bool = field(default=False, metadata={
        "help": "fine-tune the whole backbone with a new linear head on the labelled --data, scored on all of --val "
                "(top-1, top-5): MAE's recipe for ViTs, SimCLR's for CNNs"})
    from_scratch: bool = field(default=False, metadata={
        "help": "also run every protocol from a randomly initialised backbone (the run's architecture and seed), "
                "and report the difference: what pre-training bought"})
    knn_k: int = field(default=200, metadata={"range": _as_in_training("knn_k"), "help": "kNN neighbours"})
    knn_t: float = field(default=0.1, metadata={"range": _as_in_training("knn_t"), "help": "kNN temperature"})
    linear_epochs: int = field(default=100, metadata={
        "range": Range(1, MAX_EPOCHS), "help": "fast linear probe: epochs over the frozen features"})
    linear_lr: float | None = field(default=None, metadata={"range": Range(0, 1e6, lo_open=True),
        "help": "fast linear probe: learning rate; default: 1e-2 (adam) or 0.5 (sgd)"})
    linear_batch_size: int = field(default=256, metadata={"range": Range(0, MAX_BATCH),
        "help": "fast linear probe: mini-batch (0 = full batch)"})
    linear_optimizer: str = field(default="adam", metadata={"help": "fast linear probe: optimiser",
                                                            "choices": ("adam", "sgd")})
    linear_norm: str = field(default="bn", metadata={
        "help": "fast linear probe: feature normalisation: bn (standardise with training statistics), l2 or none",
        "choices": ("bn", "l2", "none")})
    epochs: int | None = field(default=None, metadata={"range": Range(1, MAX_EPOCHS), "help": _RECIPE +
        "epochs; default: the recipe's (ViT fine-tuning 100, CNN fine-tuning 60, standard linear 100)"})
    train_batch_size: int | None = field(default=None, metadata={"range": Range(1, MAX_BATCH), "help": _RECIPE +
        "global batch; default 256"})
    lr: float | None = field(default=None, metadata={"range": Range(0, 1e4, lo_open=True), "help": _RECIPE +
        "base learning rate per 256 images (scaled with the global batch); default: 5e-4 ViT fine-tuning, "
        "0.05 CNN fine-tuning, 0.1 standard linear"})
    optimizer: str | None = field(default=None, metadata={"choices": ("sgd", "adamw"), "help": _RECIPE +
        "sgd (Nesterov momentum 0.9) or adamw; default: adamw for ViT fine-tuning, else sgd"})
    weight_decay: float | None = field(default=None, metadata={"range": Range(0, 10), "help": _RECIPE +
        "weight decay (not on biases, norms, tokens); default: 0.05 ViT fine-tuning, else 0"})
    layer_decay: float | None = field(default=None, metadata={"range": Range(0, 1, lo_open=True), "help":
        "fine-tuning: layer-wise learning-rate decay; default: 0.65 for ViTs (MAE's ViT-B), none for CNNs"})
    warmup_epochs: float | None = field(default=None, metadata={"range": Range(0, MAX_EPOCHS), "help": _RECIPE +
        "linear warm-up epochs before the cosine; default: ViT fine-tuning 5 of 100 epochs (the first 5 percent), else 0"})
    drop_path: float | None = field(default=None, metadata={"range": Range(0, 1, hi_open=True), "help":
        "fine-tuning: drop-path rate of the last block (ViTs); default 0.1 for ViTs"})
    label_smoothing: float | None = field(default=None, metadata={"range": Range(0, 1, hi_open=True),
        "help": _RECIPE + "label smoothing; default: 0.1 ViT fine-tuning, else 0"})
    mixup: float | None = field(default=None, metadata={"range": Range(0, 100), "help":
        "fine-tuning: mixup's Beta alpha, samples mixed in pairs of neighbours (0: off; MAE: 0.8); default 0"})
    cutmix: float | None = field(default=None, metadata={"range": Range(0, 100), "help":
        "fine-tuning: cutmix's Beta alpha (0: off; MAE: 1.0); default 0"})
    augmentation: str | None = field(default=None, metadata={"metavar": "PRESET", "help": _RECIPE +
        "augmentation preset of one view; default: classify (random resized crop from 8 percent, flip), digits_crop "
        "for a run on the digits"})
    data_mode: str | None = field(default=None, metadata={"choices": ("auto", "memory", "stream"), "help": _RECIPE +
        "hold the training images decoded in memory, or stream them (auto: memory when they fit 2 GiB per "
        "worker); default: the run's"})
    out: str | None = field(default=None, metadata={"metavar": "DIR", "help":
        "folder of the report (eval.json, eval.md) and of the fine-tuning's checkpoints and metrics; an earlier "
        "evaluation's files there are moved to DIR/earlier-runs/<time>/ (not with --resume); default: RUN_DIR/eval"})
    resume: bool = field(default=False, metadata={
        "help": "continue an interrupted fine-tuning or standard linear evaluation from its checkpoint in --out "
                "(the same options)"})
    world_size: int = field(default=1, metadata={"range": Range(1, 2**16), "help":
        "worker processes of the fine-tuning and the standard linear protocol (exact: W workers of B/W train "
        "like one of B); under torchrun, srun or mpirun: theirs"})
    precision: str = field(default="float32", metadata={"choices": ("float32", "float64"), "help":
        "parameter dtype of the fine-tuning and the standard linear protocol (float64: exactness checks)"})
    amp: str = field(default="auto", metadata={"choices": ("auto", "bf16", "none"), "help":
        "their autocast: auto = bf16 on a GPU, none on a CPU"})
    seed: int = field(default=0, metadata={"range": _as_in_training("seed"),
        "help": "seed of the probes, the heads and the --labels draw (the held-out subsets use the run's seed)"})
    batch_size: int = field(default=512, metadata={"range": Range(1, MAX_BATCH),
                                                   "help": "images per forward pass when embedding or scoring"})
    threads: int | None = field(default=None, metadata={
        "range": _as_in_training("threads"), "help": "torch CPU threads (per worker); default: the cores shared out"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available) | cpu | cuda",
                                                  "choices": DEVICES})
    json: str | None = field(default=None, metadata={
        "help": "also write the results to this JSON file (an existing one only with --overwrite)", "metavar": "PATH"})
    overwrite: bool = field(default=False, metadata={"help": OVERWRITE_HELP + " (--json)"})

    @property
    def full_protocols(self) -> list[str]:
        """The protocols that train on the images, in the order they run."""
        standard = self.linear and self.linear_protocol in ("standard", "both")
        return [p for p, on in (("linear", standard), ("fine-tune", self.fine_tune)) if on]

    @property
    def fast_linear(self) -> bool:
        return self.linear and self.linear_protocol in ("fast", "both")

    def validate(self) -> EvalOptions:
        from unison.eval.labels import LabelBudget

        if not self.checkpoint:
            raise ConfigError("give --checkpoint RUN_DIR_OR_FILE, e.g. unison eval --checkpoint runs/default")
        if not (self.knn or self.linear or self.fine_tune):
            raise ConfigError("nothing to evaluate: drop --no-knn or --no-linear, or add --fine-tune")
        check_fields(self)   # types and the stated ranges, as `unison train` checks its options
        budget = LabelBudget.parse(self.labels)
        if self.subset is not None and not budget.everything:
            raise ConfigError(f"--subset {self.subset} and --labels {self.labels} both choose the training images; "
                              "give one: --labels N (or P%) draws a class-balanced subset of N labelled images")
        if self.resume and not self.full_protocols:
            raise ConfigError("--resume continues a fine-tuning or standard linear evaluation; add --fine-tune or "
                              "--linear-protocol standard (kNN and the fast probe take seconds: they run again)")
        checked_device(self.device)   # the one device check (`unison.load_backbone` and every checkpoint read too)
        return self
