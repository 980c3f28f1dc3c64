"""`unison check`: prove that W workers train exactly like one worker on the global batch.

The same method, initialised from the same seed, is trained for a few optimiser steps

* by W real worker processes (gloo on loopback), each on its own slice of every global
  batch (different data on each rank), wrapped in DDP exactly as `unison train` wraps it;
* by one process on the concatenated global batch.

Views come from the method's augmentation preset, whose randomness is a function of
(seed, epoch, sample index), so both runs see the same views. After every step we compare
the loss (mean over ranks vs the single-process loss), the averaged gradients, and the
full state (parameters *and* buffers: momentum encoders, queues, centres, running
statistics). The check passes when the largest relative difference
``max|a - b| / max(max|b|, tiny)`` over all tensors and steps is within the tolerance
(1e-6 in float64 mode, 1e-3 in float32), and the state is bitwise identical across ranks.

Example::

    report = run_equivalence("simclr", world_size=2, steps=4)
    print(report.summary()); assert report.passed
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

TOLERANCE = {"float64": 1e-6, "float32": 1e-3}


@dataclass
class CheckSpec:
    method: str = field(default="simclr", metadata={"help": "method to check, or 'all'"})
    world_size: int = field(default=2, metadata={"help": "worker processes of the distributed run"})
    steps: int = field(default=4, metadata={"help": "optimiser steps compared"})
    local_batch: int = field(default=8, metadata={"help": "samples per worker (the reference uses W times as many)"})
    image_size: int = field(default=16, metadata={"help": "image size of the synthetic data"})
    backbone: str = field(default="small_cnn", metadata={"help": "backbone"})
    dtype: str = field(default="float64", metadata={"help": "float64 (tolerance 1e-6) or float32 (1e-3)",
                                                     "choices": tuple(TOLERANCE)})
    sync_batchnorm: bool = field(default=True, metadata={"help": "SyncBN in the distributed run"})
    gather_distributed: bool = field(default=True, metadata={"help": "global-batch losses", "flag": "gather"})
    shared_queue: bool = field(default=True, metadata={"help": "MoCo-style queues shared by all workers"})
    seed: int = field(default=0, metadata={"help": "seed"})
    lr: float = field(default=0.05, metadata={"help": "SGD learning rate"})
    method_params: dict[str, Any] = field(default_factory=dict)


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

    @property
    def passed(self) -> bool:
        return self.ranks_identical and max(self.max_rel_loss, self.max_rel_grad, self.max_rel_state) <= self.tolerance

    def summary(self) -> str:
        s = self.spec
        lines = [
            f"unison check: method={s.method} world_size={s.world_size} steps={s.steps} "
            f"global_batch={s.local_batch * s.world_size} dtype={s.dtype} sync_batchnorm={s.sync_batchnorm} "
            f"gather={s.gather_distributed} shared_queue={s.shared_queue}",
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


def _global_images(spec: CheckSpec, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.seed * 7919 + step)
    return torch.randint(0, 256, (n, 3, spec.image_size, spec.image_size), generator=g, dtype=torch.uint8)


def _train_and_record(spec_dict: dict[str, Any]) -> dict[str, Any]:
    """Worker body (also used in-process for the single-worker reference)."""
    from unison.data.augment import ViewAugmenter
    from unison.distributed import collectives as C
    from unison.distributed.config import DistributedConfig
    from unison.distributed.ddp import unwrap, wrap_ddp
    from unison.distributed.sync_batchnorm import convert_sync_batchnorm
    from unison.methods import get_method
    from unison.models import build_backbone

    spec = CheckSpec(**spec_dict)
    dtype = getattr(torch, spec.dtype)
    torch.manual_seed(spec.seed)  # identical initialisation on every rank
    backbone, dim = build_backbone(spec.backbone)
    cls = get_method(spec.method)
    params = cls.Params(**spec.method_params)
    model = cls(backbone, dim, params, gather_distributed=spec.gather_distributed,
                shared_queue=spec.shared_queue, steps_total=spec.steps)
    model = model.to(dtype)
    device = torch.device("cpu")
    if spec.sync_batchnorm:
        model = convert_sync_batchnorm(model, device)
    cfg = DistributedConfig(world_size=C.world_size(), rank=C.rank(), sync_batchnorm=spec.sync_batchnorm,
                            gather_distributed=spec.gather_distributed, shared_queue=spec.shared_queue,
                            backend="gloo" if C.world_size() > 1 else "local")
    ddp = wrap_ddp(model, cfg, device)
    method = unwrap(ddp)
    opt = torch.optim.SGD([p for p in method.parameters() if p.requires_grad], lr=spec.lr, momentum=0.9,
                          weight_decay=1e-4)
    augment = ViewAugmenter(cls.recipe.augmentation, spec.image_size, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    global_batch = spec.local_batch * spec.world_size
    rows = C.local_slice(global_batch)
    losses, grads, states = [], [], []
    for step in range(spec.steps):
        images = _global_images(spec, step, global_batch)[rows]
        indices = torch.arange(step * global_batch, (step + 1) * global_batch)[rows]
        views = [v.to(dtype) for v in augment(images, indices, epoch=0, seed=spec.seed)]
        opt.zero_grad(set_to_none=True)
        loss = ddp(views)
        loss.backward()
        losses.append(C.all_reduce_no_grad(loss.detach(), average=True))
        grads.append({n: p.grad.detach().clone() for n, p in method.named_parameters() if p.grad is not None})
        opt.step()
        method.on_after_step(step)
        states.append({k: v.detach().clone() for k, v in method.state_dict().items()})
    final = states[-1]
    gathered = C.all_gather_object({k: v for k, v in final.items()}) if C.world_size() > 1 else [final]
    identical = all(all(torch.equal(g[k], final[k]) for k in final) for g in gathered)
    return {"losses": losses, "grads": grads, "states": states, "identical": identical,
            "note": method.exactness_note()}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, "-"
    for k, ref in b.items():
        if k not in a:
            return float("inf"), f"{k} missing"
        x, y = a[k].double(), ref.double()
        scale = max(float(y.abs().max()) if y.numel() else 0.0, 1e-12)
        d = float((x - y).abs().max()) / scale if y.numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


def compare(multi: dict[str, Any], single: dict[str, Any], spec: CheckSpec) -> CheckReport:
    worst: dict[str, str] = {}
    rl = 0.0
    for step, (a, b) in enumerate(zip(multi["losses"], single["losses"])):
        d = float((a.double() - b.double()).abs()) / max(float(b.abs()), 1e-12)
        if d > rl:
            rl, worst["loss"] = d, f"step {step}"
    rg = rs = 0.0
    for step in range(spec.steps):
        d, k = _max_rel(multi["grads"][step], single["grads"][step])
        if d > rg:
            rg, worst["grad"] = d, f"step {step}: {k}"
        d, k = _max_rel(multi["states"][step], single["states"][step])
        if d > rs:
            rs, worst["state"] = d, f"step {step}: {k}"
    return CheckReport(spec, rl, rg, rs, bool(multi["identical"]), worst, multi["note"], TOLERANCE[spec.dtype])


def run_equivalence(method: str = "simclr", world_size: int = 2, **kw: Any) -> CheckReport:
    """Train `method` on W processes and on 1 process; return the comparison."""
    from unison.distributed.testing import run_in_workers

    spec = CheckSpec(method=method, world_size=world_size, **kw)
    if spec.dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {', '.join(TOLERANCE)}, got {spec.dtype!r}")
    spec_dict = dataclasses.asdict(spec)
    multi = run_in_workers(_train_and_record, world_size, args=(spec_dict,), backend="gloo", seed=spec.seed)[0]
    single_spec = dict(spec_dict, world_size=1, local_batch=spec.local_batch * world_size)
    single = run_in_workers(_train_and_record, 1, args=(single_spec,), backend="local", seed=spec.seed)[0]
    return compare(multi, single, spec)
