"""The training step, built once: `unison train`, `unison check` and the benchmarks all run this.

    run = build_run(cfg, device)                 # data, augmentation, method, SyncBN, DDP, optimizer, schedule
    for micro in steps(run, start_step=0):       # this rank's micro-batches of each step, in the global order
        loss = accumulated_forward_backward(run, micro)   # autocast, accumulation, finite-loss check
        optimizer_step(run, micro[0].step)       # lr from the schedule, clipping, (scaled) step, EMA updates

Everything that decides what a step computes lives here and nowhere else:

* the model (`unison.training.model.build_method`): backbone (``--init`` weights loaded, ``--freeze`` applied)
  and distill's frozen teacher -> method (hyper-parameters from ``--param``) -> SyncBN (`convert_sync_batchnorm`)
  -> channels_last -> optional activation checkpointing -> DDP
  (`wrap_ddp`: comm hooks, rank-local state), or with ``--shard full`` FSDP2 (`apply_fsdp`:
  every backbone block and head sharded; ``Run.parallel_model`` is then the sharded method itself) ->
  optional ``torch.compile``; every rank is seeded identically before the build;
* the optimizer: the method's recipe unless overridden, peak learning rate scaled linearly
  with the global batch (x accumulation), optionally ZeRO-1 sharded; with ``--layer-decay`` one parameter
  group per learning-rate factor (`unison.optim.groups`);
* the schedule: linear warm-up then cosine to 0, a pure function of the step (no scheduler
  state to lose in a checkpoint), times each group's ``lr_scale``; its length and warm-up by one rule
  (`plan_length`), which a resumed run given another ``--epochs``/``--max-steps`` and a ``--time-budget`` run's plan
  (`unison.training.budget`, `apply_plan`) follow too;
* accumulation (``--grad-sync-every K``): exact (`unison.training.accumulate`: one forward on the step's K
  micro-batches, backbones re-run per micro-batch, the gradient of one step on all of them) unless
  ``--accumulation independent`` or the method's loss is a plain mean over samples (``accumulation = "plain"``);
* precision: the parameter dtype (float32, or float64 for exactness checks), bf16/fp16
  autocast (bf16 on GPU or CPU, fp16 on GPU), and a GradScaler for fp16.

`unison check` records gradients between `accumulated_forward_backward` and `optimizer_step` of exactly
this step, so what it proves is what users run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.data.augment import ViewAugmenter, eval_transform
from unison.data.batches import BatchSource
from unison.data.source import TrainData, build_batch_source
from unison.data.spec import BUILTIN, check_step
from unison.data.tensor_dataset import ImageTensorDataset
from unison.distributed import collectives as C
from unison.distributed.sync_batchnorm import convert_sync_batchnorm
from unison.errors import ConfigError, NonFiniteLossError
from unison.methods import get_method
from unison.methods.base import SampleKeys, SSLMethod
from unison.models.backbones import resolve_backbone
from unison.optim import build_optimizer, constructor_args
from unison.optim.groups import layer_scales, param_groups
from unison.optim.schedule import Schedule, Stretch
from unison.parallel.ddp import comm_hook_checkpoint_state, grad_sync_context, unwrap, wrap_ddp
from unison.training.checkpoint.extra_state import ExtraState  # the submodule: the package imports step
from unison.training.init import InitWeights
from unison.training.model import build_method, compiled
from unison.training.nonfinite import non_finite_cause
from unison.training.pieces import OWN
from unison.training.resolve import RunPlan, data_spec, exact_accumulation, plan_run

if TYPE_CHECKING:   # annotations only (unison.training.own imports this module's data_spec)
    from unison.training.pieces import OwnPieces


@dataclass
class Batch:
    """One micro-batch of this rank: micro-batch `micro` of optimiser step `step`."""

    step: int
    micro: int
    epoch: int
    indices: torch.Tensor          # this rank's sample indices into the training set
    views: list[torch.Tensor]      # augmented views, in the step's dtype and memory format
    wait_s: float = 0.0            # time spent waiting for the data of this micro-batch


@dataclass
class Run:
    """Everything one rank needs to take training steps; built by `build_run`."""

    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype
    train_set: ImageTensorDataset | None     # the decoded sets of in-memory data (None when streamed)
    val_set: ImageTensorDataset | None
    image_size: int
    augment: ViewAugmenter
    source: BatchSource
    method: SSLMethod              # the bare method (parameters, state, embed)
    parallel_model: nn.Module      # the method wrapped for data parallelism (DDP, or FSDP: the method itself)
    forward: nn.Module             # what a step calls: `parallel_model`, or `torch.compile(parallel_model)`
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast_dtype: torch.dtype | None
    schedule: Schedule
    global_batch: int
    accumulate: int                # micro-batches per optimiser step (grad_sync_every)
    steps_per_epoch: int
    data: TrainData                # the data side: source, mode, normalisation, kNN sets (`build_batch_source`)
    exact: bool = False            # exact accumulation of the K micro-batches (`unison.training.accumulate`)
    resolved: dict[str, Any] = field(default_factory=dict)   # the recipe values this run actually uses
    # with --init: the backbone as built before the weights were loaded (the random-initialisation baseline's
    # encoder, `unison.training.model.build_method`); dropped once the baseline is measured
    random_backbone: nn.Module | None = None
    extra_state: ExtraState = field(default_factory=ExtraState)   # checkpointed beyond model/optimizer

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps

    def to_eval(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> the evaluation input of this run (centre resize, training-set normalisation)."""
        x = eval_transform(images, self.image_size, self.data.mean, self.data.std).to(self.dtype)
        return x.contiguous(memory_format=torch.channels_last) if self.cfg.nhwc else x


def build_run(plan: RunPlan | TrainConfig, device: torch.device, *, train_set: ImageTensorDataset | None = None,
              val_set: ImageTensorDataset | None = None, metered_comm: bool = False,
              init: InitWeights | None = None, own: OwnPieces | None = None) -> Run:
    """Build one rank's step from the run's `plan` (`unison.training.resolve`; a validated `TrainConfig` is planned
    here, `plan_run`). `train_set`/`val_set` replace the data the plan names (``unison check``'s and the
    benchmarks' synthetic images); `metered_comm` routes DDP's gradient all-reduce through Python so
    `unison.distributed.comm_meter` counts it (``unison bench comm``); `init`: ``--init``'s tensors
    (`unison.training.init_read.init_weights_of`); `own`: the user's backbone, dataset and transform
    (`unison.training.own`). The process group must already be initialised (one process: backend local)."""
    if isinstance(plan, TrainConfig):
        plan = plan_run(plan, train_set=train_set, own=own)
    cfg = plan.cfg
    dtype = getattr(torch, cfg.precision)
    data = build_data(plan, device, train_set, val_set, own)
    if not cfg.knn:   # the reason is the flag, even where held-out data would also have been missing
        data.knn, data.knn_skipped = None, "--no-knn"
    image_size, augment, source = data.image_size, data.augment, data.source
    recipe = plan.recipe if image_size == plan.image_size else plan.recipe.at_size(cfg, image_size)
    global_batch, accumulate = cfg.batch_size, cfg.distributed.grad_sync_every
    steps_per_epoch = max(1, source.batches_per_epoch // accumulate)
    peak_lr = recipe.lr * global_batch * accumulate / 256   # scaled linearly with the global batch
    schedule = planned_schedule(cfg, steps_per_epoch, peak_lr)
    exact = exact_accumulation(cfg)
    if exact and get_method(cfg.method).needs_sample_keys and source.batches_per_epoch % accumulate:
        raise ConfigError(f"{cfg.method} takes per-sample keys (seed, epoch, index), and with {source.batches_per_epoch} "
                          f"batches per epoch a step of --grad-sync-every {accumulate} micro-batches would span two "
                          f"epochs; give a --batch-size for which the batches per epoch are a multiple of {accumulate}, "
                          "or --accumulation independent")

    # ---- model: SyncBN, memory format, DDP
    own_backbone = (own.backbone, int(own.feature_dim or 0)) if own is not None and own.backbone is not None else None
    setup: dict[str, Any] = {}   # --init / --freeze: recorded in `resolved`
    kept: dict[str, nn.Module] | None = {} if cfg.random_init_knn and cfg.knn else None   # --init: the random backbone too
    method = build_method(cfg, schedule.length, dtype, device, image_size, backbone=recipe.backbone,
                          view_sizes=augment.view_sizes, setup=setup, init=init,
                          data_size=source.batches_per_epoch * global_batch, own=own_backbone, kept=kept)
    # e.g. distill's queue length (from the data) and its teacher head's shape: kept in the run's config
    cfg.method_params = {**cfg.method_params, **method.resolved_params()}
    model: nn.Module = method
    if cfg.distributed.sync_batchnorm:
        model = convert_sync_batchnorm(model, device)
    if cfg.nhwc:
        model = model.to(memory_format=torch.channels_last)
    if cfg.distributed.activation_checkpointing:
        from unison.parallel.fsdp import apply_activation_checkpointing  # FSDP2's import: where it is used

        apply_activation_checkpointing(model)
    if cfg.distributed.shard == "full":   # FSDP2: the method itself, sharded in place
        from unison.parallel.fsdp import apply_fsdp

        parallel_model = apply_fsdp(model, device, amp=cfg.amp,
                                    reshard_after_forward=cfg.distributed.reshard_after_forward)
    else:
        parallel_model = wrap_ddp(model, cfg.distributed, device, metered=metered_comm)
    method = cast(SSLMethod, unwrap(parallel_model))   # the method itself (DDP's .module, or the FSDP-sharded method)
    method.stretch = schedule.stretch   # a budgeted run re-planned late, resumed: where its steps fall on them
    forward = compiled(parallel_model) if cfg.compile else parallel_model

    # ---- optimizer
    trainable, optimizer = _optimizer(cfg, method, recipe.optimizer, peak_lr, recipe.weight_decay)
    # bf16 autocasts on the CPU too; fp16 is refused there (`TrainConfig.validate`): its scaler is CUDA's.
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
    run = Run(cfg=cfg, device=device, dtype=dtype, train_set=data.train_set, val_set=data.val_set,
              image_size=image_size,
              augment=augment, source=source, method=method, parallel_model=parallel_model, forward=forward,
              trainable=trainable, optimizer=optimizer, scaler=scaler, autocast_dtype=autocast_dtype,
              schedule=schedule, global_batch=global_batch, accumulate=accumulate, steps_per_epoch=steps_per_epoch,
              resolved={**recipe.as_dict(), "peak_lr": peak_lr, "warmup_steps": schedule.warmup_steps,
                        "total_steps": schedule.total_steps,
                        "backbone": resolve_backbone(recipe.backbone, image_size), "image_size": image_size,
                        "data_mode": data.mode, "steps_per_epoch": steps_per_epoch, "global_batch": global_batch,
                        "accumulation": "exact" if exact else "per micro-batch" if accumulate > 1 else "none",
                        "world_size": C.world_size(), "mean": [float(m) for m in data.mean],
                        "std": [float(s) for s in data.std], "method_params": dataclasses.asdict(method.params),
                        **({"feature_dim": method.feature_dim} if own_backbone else {}),
                        **({"transform": own.transform_name()} if own is not None and own.transform else {}),
                        **recorded_paths(cfg), **setup},
              data=data, exact=exact, random_backbone=(kept or {}).get("random"))
    register_checkpoint_state(run)
    return run


def recorded_paths(cfg: TrainConfig) -> dict[str, str]:
    """``data_path``/``val_path``: the absolute form of a relative ``--data``/``--val`` (config.json and the
    checkpoints record both), so that ``unison eval`` from another folder finds the run's data."""
    out = {}
    for name in ("data", "val"):
        given = getattr(cfg, name)
        if isinstance(given, str) and given not in BUILTIN and not given.startswith(OWN) and "://" not in given:
            out[f"{name}_path"] = os.path.abspath(os.path.expanduser(given))
    return out


# ---- the run's length: how many steps, how many of them warm up

PROVISIONAL_BUDGET_STEPS = 10**9   # a budgeted run before its plan: far more steps than any budget holds
WARMUP_SHARE_MAX = 0.1       # the warm-up of a budgeted run is at most this share of its steps


def budget_warmup(steps: int, warmup_epochs: float, steps_per_epoch: int) -> int:
    """The warm-up of a budgeted run of `steps` steps: ``--warmup-epochs``, at most `WARMUP_SHARE_MAX` of its
    steps; the one rule of the first plan, of a re-plan that starts its schedules again (held there between the
    steps already trained on the ramp and the warm-up planned: `unison.training.replan`) and of a ``--max-steps``
    cap given on resume."""
    if steps <= 1:
        return 0
    return min(int(warmup_epochs * steps_per_epoch), int(WARMUP_SHARE_MAX * steps), steps - 1)


def plan_length(cfg: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """(total steps, warm-up steps): the one rule every schedule (lr, the method's momentum and temperature) is
    planned from. `--epochs` (capped by `--max-steps`), or a `--time-budget` run's plan (`unison.training.budget`),
    which ``--max-steps`` caps too (given smaller on resume: a run of that length from the start, its warm-up by
    `budget_warmup`, as a resumed ``--epochs`` run given another length is planned); unplanned
    yet, a provisional length for its measurement steps (then `apply_plan` puts the plan in place)."""
    plan = cfg.time_budget_plan
    if plan is not None:
        steps = planned_steps(cfg)
        if steps < int(plan["steps"]):   # --max-steps below the plan: the first plan's rule for the warm-up
            return steps, budget_warmup(steps, cfg.warmup_epochs, steps_per_epoch)
        return steps, int(plan["warmup_steps"])
    if cfg.time_budget is not None:   # provisional: only the measurement steps run on it
        total_steps = cfg.max_steps or PROVISIONAL_BUDGET_STEPS
    else:
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)
    warmup_steps = min(total_steps - 1, int(cfg.warmup_epochs * steps_per_epoch)) if total_steps > 1 else 0
    return total_steps, warmup_steps


def planned_steps(cfg: TrainConfig) -> int:
    """The steps of a budgeted run's plan, capped by ``--max-steps`` (given again on resume: it caps them too)."""
    assert cfg.time_budget_plan is not None
    return min(int(cfg.time_budget_plan["steps"]), cfg.max_steps or PROVISIONAL_BUDGET_STEPS)


def plan_stretch(cfg: TrainConfig) -> Stretch | None:
    """Where the steps of a budgeted run re-planned late fall on its schedules (`unison.training.replan`); None
    for every other run (its steps are the schedules' own)."""
    plan = cfg.time_budget_plan
    if plan is None or "stretch" not in plan or planned_steps(cfg) < int(plan["steps"]):
        return None   # capped by --max-steps on resume: planned as a run of that length from the start
    return Stretch.of_record(plan["stretch"], int(plan["steps"]))


def planned_schedule(cfg: TrainConfig, steps_per_epoch: int, peak_lr: float) -> Schedule:
    """The learning-rate schedule `cfg` plans (`plan_length`, `plan_stretch`, ``--final-lr-ratio``): the one rule
    `build_run` and `apply_plan` use."""
    total_steps, warmup_steps = plan_length(cfg, steps_per_epoch)
    return Schedule(peak_lr, warmup_steps, total_steps, plan_stretch(cfg), cfg.final_lr_ratio)


def apply_plan(run: Run) -> None:
    """Plan the schedules again for `run.cfg`'s length, as `build_run` did (`planned_schedule`): the lr's warm-up
    and cosine, and the method's own schedules (momentum, teacher temperature), which follow ``steps_total``; a
    budgeted run re-planned late lays its steps onto them (`unison.optim.schedule.Stretch`)."""
    run.schedule = planned_schedule(run.cfg, run.steps_per_epoch, run.schedule.peak_lr)
    run.method.steps_total, run.method.stretch = run.schedule.length, run.schedule.stretch
    run.resolved.update(total_steps=run.schedule.total_steps, warmup_steps=run.schedule.warmup_steps)


def build_data(plan: RunPlan, device: torch.device, train_set: ImageTensorDataset | None,
               val_set: ImageTensorDataset | None, own: OwnPieces | None) -> TrainData:
    """The run's data: the user's dataset (`unison.data.own`), else what the plan lists or the sets given. The
    pre-flight of the user's pieces (`unison.training.own.check_pieces`) builds it too."""
    cfg, augmentation = plan.cfg, plan.recipe.augmentation
    if own is not None and own.dataset is not None:
        from unison.data.own import build_own_source, own_image_size  # only runs given a dataset read them

        batches = cfg.max_steps * cfg.distributed.grad_sync_every if cfg.max_steps else None
        size = own_image_size(plan.spec, augmentation, own.dataset, own.transform)
        spec = data_spec(cfg, plan.recipe.at_size(cfg, size))
        data = build_own_source(spec, device, augmentation, own.dataset, own.transform, max_batches=batches)
        if own.val is not None:   # labelled held-out items: the kNN against the dataset's labelled items
            from unison.data.own_knn import own_knn_sets

            data.knn = own_knn_sets(own.dataset, own.val, data.image_size, device, cfg.seed, cfg.val_subset)
            data.knn_skipped = None
    else:
        data = build_batch_source(plan.spec, device, augmentation, train_set=train_set, val_set=val_set,
                                  catalog=plan.catalogs[0] if train_set is None else None,
                                  val_catalog=plan.catalogs[1] if train_set is None else None)
    # every source (built-in, listed, given, your own): one optimiser step of K micro-batches within an epoch
    check_step(f"--data {cfg.data}", data.num_images, cfg.batch_size, cfg.distributed.grad_sync_every)
    return data


def _optimizer(cfg: TrainConfig, method: SSLMethod, name: str, peak_lr: float,
               weight_decay: float) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """The trainable parameters and their optimizer (ZeRO-1 sharded with ``--shard optimizer``); with
    ``--layer-decay``, one parameter group per learning-rate factor (``group["lr_scale"]``, `optimizer_step`)."""
    trainable = [p for p in method.parameters() if p.requires_grad]
    params: list[Any] = trainable
    if cfg.layer_decay is not None:
        scales = layer_scales([n for n, _ in method.backbone.named_parameters()], cfg.layer_decay)
        params = param_groups(method.named_parameters(), scales)
    optimizer = build_optimizer(name, params, lr=peak_lr, weight_decay=weight_decay, momentum=cfg.momentum)
    if cfg.distributed.shard == "optimizer":
        from unison.parallel.zero import ShardedOptimizer  # --shard optimizer's: no other run imports it

        optimizer = ShardedOptimizer(params, type(optimizer), **constructor_args(optimizer))
    return trainable, optimizer


def register_checkpoint_state(run: Run) -> None:
    """What a checkpoint must carry besides model and optimizer for a resumed run to continue exactly."""
    if run.scaler.is_enabled():   # fp16 loss scale and its growth tracker
        run.extra_state.register("grad_scaler", run.scaler)
    hook_state = comm_hook_checkpoint_state(run.parallel_model)
    if hook_state is not None:     # PowerSGD error feedback (this rank's own residual), warm start, step counter
        run.extra_state.register("powersgd", hook_state, per_rank=True)


def batches(run: Run, start_step: int = 0) -> Iterator[Batch]:
    """This rank's micro-batches from optimiser step `start_step` to the end of the run, in order."""
    stream = run.source.iter_from(start_step * run.accumulate)
    step = start_step - 1
    while (step := step + 1) < run.total_steps:   # read at every step: a budgeted run re-plans its length
        for micro in range(run.accumulate):
            started = time.perf_counter()
            epoch, indices, views = next(stream)
            views = [v.to(run.dtype) for v in views]
            if run.cfg.nhwc:
                views = [v.contiguous(memory_format=torch.channels_last) for v in views]
            yield Batch(step, micro, epoch, indices, views, time.perf_counter() - started)


def steps(run: Run, start_step: int = 0) -> Iterator[list[Batch]]:
    """This rank's micro-batches grouped by optimiser step (`run.accumulate` each), from `start_step` on."""
    return grouped(batches(run, start_step), run.accumulate)


def grouped(micro_batches: Iterable[Batch], accumulate: int) -> Generator[list[Batch], None, None]:
    """`micro_batches` (in order) as the lists of one optimiser step each: exact accumulation needs them all."""
    micro: list[Batch] = []
    for batch in micro_batches:
        micro.append(batch)
        if batch.micro == accumulate - 1:
            yield micro
            micro = []


def accumulated_forward_backward(run: Run, micro_batches: Sequence[Batch],
                                 before_micro: Callable[[Batch], None] | None = None) -> torch.Tensor:
    """Forward and backward of one optimiser step's `run.accumulate` micro-batches; returns this rank's loss of the
    step (detached): with exact accumulation (`run.exact`) the loss of all of them as one batch, otherwise the mean
    of the micro-batches' losses (equal for a plain mean over samples). The loop and `unison check` both call it;
    the loop's `before_micro` (called before each micro-batch's forward, without exact accumulation) may end a
    long step (a stop signal)."""
    if not run.exact:
        losses = []
        for batch in micro_batches:
            if before_micro is not None:
                before_micro(batch)
            losses.append(forward_backward(run, batch))
        return torch.stack(losses).mean()
    from unison.training.accumulate import ExactAccumulation, average_gradients, no_sync  # K > 1 micro-batches only

    first = micro_batches[0]
    views = [torch.cat([b.views[v] for b in micro_batches]) for v in range(len(first.views))]
    if run.cfg.nhwc:
        views = [v.contiguous(memory_format=torch.channels_last) for v in views]
    whole = Batch(first.step, 0, first.epoch, torch.cat([b.indices for b in micro_batches]), views)
    # pass 1 (embeddings without graphs, the loss on all of them, its backward), pass 2 (each micro-batch's
    # backbone again with its graph), all without DDP's all-reduce; then the gradients averaged once
    with no_sync(run.parallel_model), C.micro_batch_layout(len(micro_batches)), \
            ExactAccumulation(run.method, len(micro_batches), first.indices.shape[0]) as cache:
        loss = _loss(run, whole)
        run.scaler.scale(loss).backward()
        cache.replay()
    average_gradients(run.trainable)
    return loss.detach()


def forward_backward(run: Run, batch: Batch) -> torch.Tensor:
    """Forward and backward of one micro-batch, its loss weighted 1/K; returns this rank's loss (detached).

    Gradients are all-reduced by DDP on the last micro-batch of the step only."""
    with grad_sync_context(run.parallel_model, batch.micro, run.accumulate):
        loss = _loss(run, batch)
        run.scaler.scale(loss / run.accumulate).backward()
    return loss.detach()


def _loss(run: Run, batch: Batch) -> torch.Tensor:
    """The method's loss on `batch` under the run's autocast. A non-finite loss raises `NonFiniteLossError`
    before its backward, so the last checkpoint stays the last good state."""
    kwargs = {}
    if run.method.needs_sample_keys:   # masks drawn per sample (MAE, iBOT, I-JEPA): never from the rank
        crops = run.source.crop_geometry(batch.epoch, batch.indices) if run.method.needs_crop_geometry else None
        kwargs["keys"] = SampleKeys(run.cfg.seed, batch.epoch, batch.indices, crops)
    with torch.autocast(run.device.type, dtype=run.autocast_dtype or torch.float32,
                        enabled=run.autocast_dtype is not None):
        loss = run.forward(batch.views, **kwargs)
    if not torch.isfinite(loss):
        cause = non_finite_cause(run.method, batch.views, run.cfg, batch.step)
        raise NonFiniteLossError(f"non-finite loss ({float(loss.detach())}) at step {batch.step} on rank {C.rank()}; "
                                 f"{cause}" + (" (the last checkpoint is intact)" if batch.step else ""))
    return loss


def optimizer_step(run: Run, step: int) -> float:
    """Optimiser step `step` (0-based) on the accumulated gradients; returns its learning rate."""
    lr = run.schedule.lr(step)
    for group in run.optimizer.param_groups:   # --layer-decay: each group its factor of the schedule's rate
        group["lr"] = lr * group.get("lr_scale", 1.0)
    if run.cfg.grad_clip:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.trainable, run.cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.method.on_after_step(step)
    return lr


def threads_per_worker(cfg: TrainConfig, world: int) -> int:
    """torch threads of one worker: ``--threads``, else the cores shared evenly by the workers."""
    return cfg.threads or max(1, (os.cpu_count() or 1) // world)
