"""`unison check`: prove that W workers train exactly like one worker on the global batch.

The production step (`unison.training.step`: the method with its hyper-parameters, SyncBN,
DDP, the recipe's optimizer, the learning-rate schedule, the precision) is built and run
for a few optimiser steps

* by W real worker processes (gloo on loopback), each on its own slice of every global
  batch (different data on each rank);
* by one process on the whole global batch.

Both read the same synthetic images in the same global order (a function of (seed,
epoch)), and a sample's views depend on (seed, epoch, sample index) only, so both see the
same views. Gradients are recorded between `forward_backward` and `optimizer_step` — the
gradients the production optimizer then applies. After every step we compare the loss (mean
over ranks vs the single-process loss), the averaged gradients, and the full state
(parameters *and* buffers: momentum encoders, queues, centres, running statistics). The
check passes when the largest relative difference (`max_rel_difference`) over all tensors
and steps is within the tolerance (1e-6 in float64, 1e-3 in float32), and the state is
bitwise identical across ranks.

Example::

    report = run_equivalence("simclr", world_size=2, steps=4)
    print(report.summary()); assert report.passed
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from unison.config.check import TOLERANCE, CheckSpec

from .compare import max_rel_difference

if TYPE_CHECKING:   # annotations only; the functions below import them when called
    from unison.config import TrainConfig
    from unison.data.tensor_dataset import ImageTensorDataset
    from unison.training.pieces import OwnPieces

@dataclass
class CheckReport:
    spec: CheckSpec
    max_rel_loss: float
    max_rel_grad: float
    max_rel_state: float
    ranks_identical: bool
    worst: dict[str, str]
    note: str | None
    tolerance: float
    reference: str = "one process on the global batch"   # what the W-worker run was compared with
    pieces: str = ""   # the user's own pieces checked (``unison.check(..., backbone=..., dataset=...)``), if any
    batch_note: str = ""   # why the check ran at a larger batch than asked (`fitted_batch`)

    @property
    def passed(self) -> bool:
        return self.ranks_identical and max(self.max_rel_loss, self.max_rel_grad, self.max_rel_state) <= self.tolerance

    def summary(self) -> str:
        s = self.spec
        lines = [
            f"unison check: method={s.method} world_size={s.world_size} steps={s.steps} "
            f"global_batch={s.local_batch * s.world_size} dtype={s.dtype} sync_batchnorm={s.sync_batchnorm} "
            f"gather={s.gather_distributed} shared_queue={s.shared_queue} shard={s.shard} "
            f"grad_sync_every={s.grad_sync_every}" + (f" accumulation={s.accumulation}" if s.grad_sync_every > 1 else "")
            + (f" layer_decay={s.layer_decay}" if s.layer_decay is not None else "")
            + (f" freeze={s.freeze}" if s.freeze else "")
            + " (the training step of unison train)"
            + f"\n  compared with                       : {self.reference}"
            + (f"\n  data: {s.data}, streamed at {s.image_size} px" if s.data else "")
            + (f"\n  your pieces                         : {self.pieces}" if self.pieces else "")
            + (f"\n  batch                               : {self.batch_note}" if self.batch_note else ""),
            f"  max relative difference, loss       : {self.max_rel_loss:.3e}   ({self.worst.get('loss', '-')})",
            f"  max relative difference, gradients  : {self.max_rel_grad:.3e}   ({self.worst.get('grad', '-')})",
            f"  max relative difference, parameters : {self.max_rel_state:.3e}   ({self.worst.get('state', '-')})",
            f"  state identical on every rank       : {'yes' if self.ranks_identical else 'NO'}",
        ]
        if self.note:
            lines.append(f"  not exactly equivalent here         : {self.note}")
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"  {verdict}: tolerance {self.tolerance:.0e} ({s.dtype})")
        return "\n".join(lines)


def train_config_for(spec: CheckSpec, world_size: int, own: OwnPieces | None = None) -> TrainConfig:
    """The `unison train` configuration a check runs: one epoch of `spec.steps` global batches (synthetic
    images), or `spec.steps` global batches of `spec.data`, streamed, or of the user's own dataset (`own`, whose
    pieces it names: `OwnPieces.apply`)."""
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.augment import PRESETS
    from unison.methods import get_method
    from unison.training.resolve import TEACHER_RANDOM, needs_teacher

    # distill: a seeded random-init teacher (the check is about the student's gradient); another method given
    # --teacher-backbone is refused by the pre-flight, as unison train refuses it
    teacher: dict[str, Any] = {"teacher": TEACHER_RANDOM} if needs_teacher(spec.method) else {}
    teacher["teacher_backbone"] = spec.teacher_backbone
    # SwAV, DINO and LeJEPA drop their local crops at the check's small images by default
    # (`Recipe.global_views_up_to`): the check keeps them, since the local-crop path is what needs checking
    recipe = get_method(spec.method).recipe
    crops = {"local_crops": PRESETS[recipe.augmentation]["n_local"]} if recipe.global_views_up_to else {}
    streamed: dict[str, Any] = {"data": spec.data, "data_mode": "stream", "loader_workers": 1, "image_size": spec.image_size,
                "epochs": spec.steps} if spec.data else {"data": "synthetic", "epochs": 1}
    if own is not None and own.dataset is not None:   # in the training process: views independent of it anyway
        streamed = {"epochs": spec.steps, "loader_workers": 0,
                    "image_size": None if own.transform is not None else spec.image_size}
    cfg = TrainConfig(
        method=spec.method, backbone=spec.backbone, max_steps=spec.steps, **streamed,
        batch_size=spec.local_batch * spec.world_size, lr=spec.lr, precision=spec.dtype, seed=spec.seed,
        threads=1, progress=False, method_params=dict(spec.method_params), layer_decay=spec.layer_decay,
        freeze=spec.freeze, **teacher, **crops,
        distributed=DistributedConfig(backend="gloo" if world_size > 1 else "local", world_size=world_size,
                                      sync_batchnorm=spec.sync_batchnorm, gather_distributed=spec.gather_distributed,
                                      shared_queue=spec.shared_queue, grad_sync_every=spec.grad_sync_every,
                                      accumulation=spec.accumulation,
                                      shard=spec.shard if world_size > 1 else "none"))
    if own is not None:
        own.apply(cfg)
    return cfg


def synthetic_images(spec: CheckSpec) -> ImageTensorDataset:
    """steps x K micro-batches x global batch random uint8 images (a pure function of the seed): one epoch."""
    from unison.data.synthetic import synthetic_dataset

    return synthetic_dataset(spec.steps * spec.grad_sync_every * spec.local_batch * spec.world_size, spec.image_size,
                             spec.seed)


def record_steps(spec_dict: dict[str, Any], own: OwnPieces | None = None) -> dict[str, Any]:
    """Worker body (also run in-process for the single-worker reference): the production step's
    losses, gradients and states, step by step. `own`: the user's pieces (`unison.training.own`)."""
    from unison.distributed import collectives as C
    from unison.distributed.dtensor import full_tensor
    from unison.training.accumulate import backbones
    from unison.training.step import accumulated_forward_backward, build_run, optimizer_step, steps

    spec = CheckSpec(**spec_dict)
    torch.set_num_threads(1)
    cfg = train_config_for(spec, C.world_size(), own)
    given = spec.data or (own is not None and own.dataset is not None)
    device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")   # ranks share GPU 0
    run = build_run(cfg, device, train_set=None if given else synthetic_images(spec), own=own)
    losses, grads, states = [], [], []
    for micro in steps(run):
        losses.append(C.all_reduce_no_grad(accumulated_forward_backward(run, micro), average=True).cpu())
        # full_tensor: sharded (FSDP) gradients and parameters gathered whole (a collective; plain ones as they are)
        grads.append({n: full_tensor(p.grad).detach().cpu().clone() for n, p in run.method.named_parameters()
                      if p.grad is not None})
        optimizer_step(run, micro[0].step)
        states.append({k: full_tensor(v).detach().cpu().clone() for k, v in run.method.state_dict().items()})
    # Every rank must hold the same state; per-rank queues (shared_queue off) differ by design.
    final = {k: v for k, v in states[-1].items() if spec.shared_queue or "queue" not in k}
    gathered = C.all_gather_object(final) if C.world_size() > 1 else [final]
    identical = all(all(torch.equal(g[k], final[k]) for k in final) for g in gathered)
    batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or "BatchNorm" in type(m).__name__
                     for b in backbones(run.method) for m in b.modules())
    return {"losses": losses, "grads": grads, "states": states, "identical": identical,
            "note": run.method.exactness_note(), "backbone_batch_norm": batch_norm}


def compare(multi: dict[str, Any], single: dict[str, Any], spec: CheckSpec) -> CheckReport:
    """The check's verdict from rank 0's record of the W-worker run and the single-process record."""
    worst: dict[str, str] = {}
    rl = 0.0
    for step, (a, b) in enumerate(zip(multi["losses"], single["losses"])):
        d = float((a.double() - b.double()).abs()) / max(float(b.abs()), 1e-12)
        if d > rl:
            rl, worst["loss"] = d, f"step {step}"
    if len(multi["losses"]) != len(single["losses"]):
        rl, worst["loss"] = float("inf"), "the runs took different numbers of steps"
    rg = rs = 0.0
    for step in range(min(len(multi["grads"]), len(single["grads"]))):
        d, k = max_rel_difference(multi["grads"][step], single["grads"][step])
        if d > rg:
            rg, worst["grad"] = d, f"step {step}: {k}"
        d, k = max_rel_difference(multi["states"][step], single["states"][step])
        if d > rs:
            rs, worst["state"] = d, f"step {step}: {k}"
    return CheckReport(spec, rl, rg, rs, bool(multi["identical"]), worst, multi["note"], TOLERANCE[spec.dtype],
                       reference(spec, multi)[1])


def reference(spec: CheckSpec, multi: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The single-process reference of a W-worker record, and what its comparison guarantees. Accumulation over K
    micro-batches: one step on the whole K x global batch where the backbone has no batch norm (heads see the whole
    step under exact accumulation); with batch norm in the backbone, whose statistics are per micro-batch, the
    same K micro-batches (world-size invariance)."""
    spec_dict = dataclasses.asdict(spec)
    w, k, b = spec.world_size, spec.grad_sync_every, spec.local_batch
    if k > 1 and (spec.accumulation == "exact" or _method_accumulation(spec.method) == "plain") \
            and not multi.get("backbone_batch_norm", True):
        return (dict(spec_dict, world_size=1, local_batch=b * w * k, grad_sync_every=1),
                f"one process in ONE step on the whole batch of {b * w * k} (no batch norm in the backbone: "
                f"{k} micro-batches == one batch)")
    if k > 1:
        why = ("batch norm in the backbone: statistics per micro-batch, so world-size invariance"
               if spec.accumulation == "exact" else "independent accumulation: a loss per micro-batch")
        return (dict(spec_dict, world_size=1, local_batch=b * w),
                f"one process on the same {k} micro-batches of {b * w} ({why})")
    return dict(spec_dict, world_size=1, local_batch=b * w), f"one process on the global batch of {b * w}"


def _method_accumulation(method: str) -> str:
    from unison.methods import get_method

    return get_method(method).accumulation


def record_each(spec_dicts: list[dict[str, Any]], record: Callable[[dict[str, Any]], dict[str, Any]]) -> list[Any]:
    """Worker body of a batched check: `record` for each spec in turn, in the same process group."""
    return [record(spec_dict) for spec_dict in spec_dicts]


def check_methods(given: str, known: Mapping[str, Any]) -> list[str]:
    """``unison check --method``: one method, a comma-separated list, or 'all'; an unknown name in one line."""
    from unison.config.fields import did_you_mean
    from unison.errors import ConfigError

    names = list(dict.fromkeys(n.strip() for n in given.split(",") if n.strip()))
    if not names:
        raise ConfigError("--method is empty; give a method (e.g. simclr), several separated by commas, or 'all'")
    if names == ["all"]:
        return sorted(known)
    for name in names:
        if name not in known:
            raise ConfigError(f"--method {name!r} is unknown{did_you_mean(name, known)}; give one of "
                              f"{', '.join(sorted(known))}, several separated by commas, or 'all'")
    return names


def validate_check_specs(specs: list[CheckSpec], cuda_available: bool) -> None:
    """The check's own options (those `unison train` does not have); raises `ConfigError` with a one-line fix."""
    from unison.config.fields import check_fields
    from unison.errors import ConfigError

    for spec in specs:   # each value's type and range, in the check's own names (world_size=0, not batch_size=0)
        check_fields(spec)
    if any(spec.dtype not in TOLERANCE for spec in specs):
        raise ConfigError(f"dtype must be one of {', '.join(TOLERANCE)}, got {specs[0].dtype!r}")
    if any(spec.device == "cuda" and spec.shard == "full" for spec in specs):
        # FSDP2's collectives on CUDA tensors over gloo crash the ranks (SIGSEGV): refused before they start
        raise ConfigError("--device cuda runs the ranks over gloo, which cannot run FSDP's collectives on CUDA "
                          "tensors; check --shard full with --device cpu (the same code path)")
    if any(spec.device == "cuda" for spec in specs) and not cuda_available:
        raise ConfigError("--device cuda: torch sees no CUDA device here; leave --device at cpu")


def fitted_batch(spec: CheckSpec) -> tuple[CheckSpec, str]:
    """`spec`, with the local batch raised where one forward of the method would see fewer images than its loss is
    defined on (`SSLMethod.smallest_batch`: W-MSE whitens groups wider than its embedding), and why; else `spec` and
    "". So ``unison check --method all`` checks every method at the check's small default batch or the least above
    it that the method takes."""
    from unison.methods import get_method
    from unison.training.resolve import validated_method_params

    method = get_method(spec.method)
    smallest = method.smallest_batch(method.Params(**validated_method_params(spec.method, spec.method_params)))
    k = spec.grad_sync_every if (spec.grad_sync_every > 1 and spec.accumulation == "exact"
                                 and method.accumulation == "exact") else 1   # exact: one forward on K micro-batches
    per_forward = spec.local_batch * spec.world_size * k
    if per_forward >= smallest:
        return spec, ""
    local = -(-smallest // (spec.world_size * k))
    return (dataclasses.replace(spec, local_batch=local),
            f"local batch {spec.local_batch} raised to {local}: {spec.method} needs at least {smallest} images in one "
            f"forward, {per_forward} given")


def run_equivalence_all(methods: list[str], world_size: int = 2, *,
                        record: Callable[[dict[str, Any]], dict[str, Any]] = record_steps,
                        own: OwnPieces | None = None, **kw: Any) -> list[CheckReport]:
    """`run_equivalence` for several methods, each W workers against 1 process, in ONE launch of W workers (the
    process start-up, a few seconds, is paid once: ``unison check --method all``). Every method builds its run
    from its own seed, so each report is the one `run_equivalence` gives.

    `record` is the worker body (tests pass a deliberately broken copy to see the check fail); `own`: the user's
    backbone, dataset and transform, checked as `unison.train` checks them and sent to the workers pickled."""
    from unison.distributed.start import refuse_reentered_main
    from unison.distributed.testing import run_in_workers
    from unison.training.init_read import check_backbone_setup
    from unison.training.own import check_picklable, check_pieces
    from unison.training.resolve import plan_run, validate_run

    refuse_reentered_main("unison.check")   # a script without the main guard, re-run by a worker
    given = [CheckSpec(method=method, world_size=world_size, **kw) for method in methods]
    validate_check_specs(given, torch.cuda.is_available())   # as given: world_size=0 named before it is used
    fitted = [fitted_batch(spec) for spec in given]
    specs = [spec for spec, _ in fitted]
    for spec in specs:   # the pre-flight of unison train: a bad combination is one line, before any worker starts
        cfg = validate_run(train_config_for(spec, world_size, own), own=own)
        plan = plan_run(cfg, own=own, train_set=None if spec.data else synthetic_images(spec))
        if own is not None:
            check_pieces(plan, own)
        check_backbone_setup(plan.cfg, plan.recipe.backbone, spec.image_size)   # --freeze, --layer-decay
    if own is not None:
        check_picklable(own)
        record = functools.partial(cast(Any, record), own=own)
    spec_dicts = [dataclasses.asdict(spec) for spec in specs]
    seed = specs[0].seed if specs else 0
    multi = run_in_workers(record_each, world_size, args=(spec_dicts, record), backend="gloo", seed=seed,
                           timeout_s=600)[0]
    reports = []
    for (spec, batch_note), recorded in zip(fitted, multi):
        single_spec = reference(spec, recorded)[0]
        single = run_in_workers(record, 1, args=(single_spec,), backend="local", seed=spec.seed)[0]
        reports.append(compare(recorded, single, spec))
        reports[-1].batch_note = batch_note
    if own is not None:
        cfg = train_config_for(specs[0], world_size, own)
        named = {"backbone": own.backbone is not None and cfg.backbone, "dataset": own.dataset is not None and cfg.data,
                 "transform": own.transform is not None and own.transform_name()}
        for report in reports:
            report.pieces = ", ".join(f"{k} {v}" for k, v in named.items() if v)
    return reports


def run_equivalence(method: str = "simclr", world_size: int = 2, *,
                    record: Callable[[dict[str, Any]], dict[str, Any]] = record_steps, own: OwnPieces | None = None,
                    **kw: Any) -> CheckReport:
    """Train `method` on W processes and on 1 process with the production step; return the comparison.

    `record` is the worker body (tests pass a deliberately broken copy to see the check fail); `own`: the user's
    pieces (`unison.training.own`)."""
    return run_equivalence_all([method], world_size, record=record, own=own, **kw)[0]
