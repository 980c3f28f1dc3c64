"""End-to-end fine-tuning (and the standard linear protocol) of a classifier, exact at any world size.

`fine_tune(job)` trains `job.model` (a `unison.eval.classifier.Classifier`) on this rank's share of every
global batch of `job.source` (the data layer's `BatchSource`: the global order and the views are functions of
(seed, epoch, index)), for ``recipe.epochs`` epochs, then scores it on the held-out images
(`unison.eval.scores.topk_accuracy`: top-1 and top-5 of the whole set). One step::

    lr(step)        = schedule(step) x the group's layer-decay factor   (linear warm-up, cosine to 0)
    loss            = cross-entropy(model(views), labels, label smoothing)  mean over this rank's samples
    (mixed targets with --mixup / --cutmix: `unison.eval.mix`)
    DDP             averages the gradients: the gradient of the global batch's mean loss
    optimizer step  SGD with Nesterov momentum or AdamW; no weight decay on biases, norms, tokens and position
                    embeddings (as MAE and timm)

so that W workers of B/W samples take the steps of one worker of B samples: the batch norms are synchronised
(the caller converts them: `unison.distributed.sync_batchnorm`), drop path draws from (seed, epoch, index), and
the caller's `wrap` is unison's DDP wiring. One all-reduce per step carries the loss, the correct count, the
sample count and whether any rank was asked to stop (SIGTERM or SIGUSR1, `unison.distributed.signals`): every
rank then saves (rank 0 writes) and raises `Preempted` after the same step, and ``--resume`` continues from
there exactly (`unison.eval.finetune_state`). A checkpoint is also written at the end of an epoch when a minute
has passed since the last one (a few labels make epochs of one step), and at the end.

Progress on rank 0's standard error: a line at each epoch's end and at most every 30 s between (``unison eval:
fine-tune epoch 3/10, step 120/400: loss 1.234, train top-1 0.512, lr 0.0012, 310 img/s``); the same per epoch
in ``metrics.csv``.

Example::

    job = FineTuneJob(model=classifier, source=data.source, labels_of=data.labels_at, val_images=images,
                      val_labels=labels, num_classes=10, to_eval=to_eval, recipe=recipe, seed=0,
                      device=device, out=Path("runs/x/eval/fine-tune"), record={...}, wrap=ddp)
    result = fine_tune(job)          # FineTuneResult: top1, top5, steps, ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.data.batches import BatchSource
from unison.distributed.collectives import all_reduce_no_grad, rank
from unison.distributed.signals import stop_requests
from unison.errors import NonFiniteLossError, Preempted
from unison.optim.groups import layer_scales
from unison.optim.schedule import Schedule

from .classifier import Classifier, DropPathKeys
from .finetune_state import MetricsFile, check_record, load_state, save_state
from .mix import PairMixer
from .recipe import ClassifierRecipe
from .scores import Scores, topk_accuracy

__all__ = ["FineTuneJob", "FineTuneResult", "fine_tune", "parameter_groups"]

_NO_DECAY = ("cls_token", "pos_embed", "reg_token", "mask_token")


@dataclass
class FineTuneJob:
    """Everything one rank needs to fine-tune (see the module docstring)."""

    model: Classifier                          # on its device and dtype, batch norms synchronised
    source: BatchSource                        # this rank's share of every global batch, one view each
    labels_of: Callable[[torch.Tensor], torch.Tensor]   # class labels of training indices
    val_images: Any                            # uint8 tensor or lazily decoded images
    val_labels: torch.Tensor
    num_classes: int
    to_eval: Callable[[torch.Tensor], torch.Tensor]     # uint8 -> the model's input (held-out images)
    recipe: ClassifierRecipe
    seed: int
    device: torch.device
    out: Path                                  # checkpoint.pt and metrics.csv
    record: dict[str, Any]                     # what a resume must match (`check_record`)
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None        # bf16 on a GPU
    wrap: Callable[[nn.Module], nn.Module] = field(default=lambda m: m)   # DDP (the caller's wiring)
    resume: bool = False
    drop_path: DropPathKeys | None = None
    channels_last: bool = False
    eval_batch_size: int = 512
    name: str = "fine-tune"                    # what the progress lines call it
    before_step: Callable[[int], None] | None = None   # called with the step about to run (fault tests)
    log_every_s: float = 30.0
    checkpoint_every_s: float = 60.0           # at an epoch's end, when this long since the last save


@dataclass
class FineTuneResult:
    scores: Scores
    steps: int
    steps_per_epoch: int
    final_loss: float | None
    train_top1: float | None
    resumed_from: int | None                   # the step a resumed run continued from
    train_time_s: float


def parameter_groups(model: Classifier, recipe: ClassifierRecipe) -> list[dict[str, Any]]:
    """The trainable parameters grouped by (layer-decay factor, weight decay or none)."""
    names = [n for n, _ in model.backbone.named_parameters()]
    scales = layer_scales(names, recipe.layer_decay) if recipe.layer_decay is not None else {}
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        inner = name[len("backbone."):] if name.startswith("backbone.") else None
        scale = scales.get(inner, 1.0) if inner is not None else 1.0
        no_decay = p.ndim <= 1 or name.split(".")[-1] in _NO_DECAY
        groups.setdefault((scale, 0.0 if no_decay else recipe.weight_decay), []).append(p)
    return [{"params": ps, "lr_scale": s, "weight_decay": wd}
            for (s, wd), ps in sorted(groups.items(), key=lambda kv: (-kv[0][0], -kv[0][1]))]


def build_optimizer(model: Classifier, recipe: ClassifierRecipe) -> torch.optim.Optimizer:
    groups = parameter_groups(model, recipe)
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=recipe.lr, momentum=recipe.momentum, nesterov=recipe.momentum > 0)
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(recipe.momentum, 0.999))


def fine_tune(job: FineTuneJob) -> FineTuneResult:
    """Train and score `job` on this rank (collective: every rank calls it); see the module docstring."""
    recipe = job.recipe
    per_epoch = job.source.batches_per_epoch
    total = recipe.epochs * per_epoch
    schedule = Schedule(peak_lr=recipe.lr, warmup_steps=round(recipe.warmup_epochs * per_epoch), total_steps=total)
    optimizer = build_optimizer(job.model, recipe)
    step, done, resumed_from = _restore(job, optimizer)
    metrics = MetricsFile(job.out, enabled=rank() == 0, append=resumed_from is not None)
    net = job.wrap(job.model)
    mixer = PairMixer(recipe.mixup, recipe.cutmix, recipe.label_smoothing, job.num_classes, job.seed)
    log = _Progress(job, total, per_epoch, metrics)
    started = saved = time.perf_counter()
    if not done:
        job.model.train()
        stops = stop_requests()
        for epoch, indices, views in job.source.iter_from(step):
            if job.before_step is not None:
                job.before_step(step)
            lr = schedule.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_scale"]
            sums = _step(job, net, optimizer, mixer, epoch, indices, views[0])
            sums[3] = float(stops.requested)
            sums = all_reduce_no_grad(sums)
            step += 1
            log.step(step, epoch, sums, lr)
            if step == total:
                break
            if sums[3] > 0 or (step % per_epoch == 0 and time.perf_counter() - saved >= job.checkpoint_every_s):
                _save(job, optimizer, step, done=False)
                saved = time.perf_counter()
            if sums[3] > 0:
                raise Preempted(f"{job.name} stopped by {stops.name() or 'a stop request'} after step {step} of "
                                f"{total}; continue it with the same command and --resume",
                                signal_name=stops.name())
        _save(job, optimizer, step, done=True)
    job.model.eval()
    scores = topk_accuracy(job.model, job.val_images, job.val_labels, job.to_eval, job.eval_batch_size,
                           job.num_classes, f"eval: {job.name}: scoring the held-out set", job.device)
    metrics.row(step=step, epoch=step / max(1, per_epoch), val_top1=scores.top1, val_top5=scores.top5)
    return FineTuneResult(scores, step, per_epoch, log.last_loss, log.last_top1, resumed_from,
                          time.perf_counter() - started)


def _restore(job: FineTuneJob, optimizer: torch.optim.Optimizer) -> tuple[int, bool, int | None]:
    """(step, done, resumed-from step) from ``--resume``'s checkpoint, or (0, False, None)."""
    state = load_state(job.out, job.device) if job.resume else None
    if state is None:
        return 0, False, None
    check_record(job.out / "checkpoint.pt", state["record"], job.record)
    job.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), bool(state.get("done")), int(state["step"])


def _save(job: FineTuneJob, optimizer: torch.optim.Optimizer, step: int, done: bool) -> None:
    if rank() == 0:
        save_state(job.out, {"model": job.model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                             "done": done, "record": job.record})


def _step(job: FineTuneJob, net: nn.Module, optimizer: torch.optim.Optimizer, mixer: PairMixer, epoch: int,
          indices: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """One optimiser step on this rank's samples; returns [loss sum, correct, samples, 0] (float64)."""
    x = view.to(job.dtype)
    y = job.labels_of(indices).to(x.device)
    x, target = mixer(x, y, indices, epoch)
    if job.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if job.drop_path is not None:
        job.drop_path.set(job.seed, epoch, indices.to(x.device))
    with torch.autocast(job.device.type, dtype=job.autocast or torch.float32, enabled=job.autocast is not None):
        logits = net(x)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if target is None:
        loss = F.cross_entropy(logits, y, label_smoothing=job.recipe.label_smoothing)
    else:
        loss = torch.sum(-target.to(logits.dtype) * F.log_softmax(logits, dim=1), dim=1).mean()
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"{job.name}: non-finite loss ({float(loss.detach())}) on rank {rank()}; lower "
                                 f"--lr (the base rate was {job.recipe.base_lr:g} per 256 images)")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if job.drop_path is not None:
        job.drop_path.clear()
    n = float(y.numel())
    correct = float((logits.detach().argmax(1) == y).sum())
    return torch.tensor([float(loss.detach()) * n, correct, n, 0.0], dtype=torch.float64, device=_reduce_device(job))


def _reduce_device(job: FineTuneJob) -> torch.device:
    return job.device if job.device.type == "cuda" else torch.device("cpu")


class _Progress:
    """Rank 0's lines on standard error and its rows of ``metrics.csv`` (see the module docstring)."""

    def __init__(self, job: FineTuneJob, total: int, per_epoch: int, metrics: MetricsFile):
        self.job, self.total, self.per_epoch, self.metrics = job, total, per_epoch, metrics
        self.show = rank() == 0
        self.epoch_sums = torch.zeros(3, dtype=torch.float64)
        self.last_loss: float | None = None
        self.last_top1: float | None = None
        self.started = self.last_line = time.perf_counter()
        self.images = 0.0

    def step(self, step: int, epoch: int, sums: torch.Tensor, lr: float) -> None:
        sums = sums.cpu()
        self.epoch_sums += sums[:3]
        self.images += float(sums[2])
        now = time.perf_counter()
        end_of_epoch = step % self.per_epoch == 0 or step == self.total
        if not (end_of_epoch or now - self.last_line >= self.job.log_every_s):
            return
        loss = float(self.epoch_sums[0] / self.epoch_sums[2]) if self.epoch_sums[2] else float("nan")
        top1 = float(self.epoch_sums[1] / self.epoch_sums[2]) if self.epoch_sums[2] else float("nan")
        rate = self.images / max(1e-9, now - self.started)
        self.last_loss, self.last_top1 = loss, top1
        if self.show:
            print(f"unison eval: {self.job.name} epoch {epoch + 1}/{self.job.recipe.epochs}, step {step}/{self.total}: "
                  f"loss {loss:.4f}, train top-1 {top1:.4f}, lr {lr:.4g}, {rate:.0f} img/s", file=sys.stderr,
                  flush=True)
        self.last_line = now
        if end_of_epoch:
            self.metrics.row(step=step, epoch=step / self.per_epoch, loss=loss, train_top1=top1, lr=lr,
                             images_per_s=round(rate, 1))
            self.epoch_sums.zero_()
