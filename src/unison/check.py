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

Whole runs (``unison check --run``, `run_curves`): `unison train` itself, at 1 and W workers
with the same seed and global batch on the digits data, logging the loss at every step; the
two loss curves must agree within `CURVE_TOLERANCE` at every step::

    report = run_curves("simclr", steps=200, world_sizes=(1, 2))   # about 2-3 minutes on 2 cores
    print(report.summary()); assert report.passed
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TOLERANCE = {"float64": 1e-6, "float32": 1e-3}
# Relative differences are measured against at least this fraction of the step's largest value.
RELATIVE_FLOOR = 1e-3


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
    # Every rank must hold the same state; per-rank queues (shared_queue off) differ by design.
    final = {k: v for k, v in states[-1].items() if spec.shared_queue or "queue" not in k}
    gathered = C.all_gather_object(final) if C.world_size() > 1 else [final]
    identical = all(all(torch.equal(g[k], final[k]) for k in final) for g in gathered)
    return {"losses": losses, "grads": grads, "states": states, "identical": identical,
            "note": method.exactness_note()}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative difference over tensors: max|a-b| / max(max|b|, FLOOR * largest |b| of the step).

    The floor keeps a tensor whose exact value is zero (e.g. the gradient of a bias followed
    by batch norm) from measuring its rounding noise against itself.
    """
    step_scale = max((float(v.double().abs().max()) for v in b.values() if v.numel()), default=0.0)
    floor = max(RELATIVE_FLOOR * step_scale, 1e-300)
    worst, where = 0.0, "-"
    for k, ref in b.items():
        if k not in a:
            return float("inf"), f"{k} missing"
        if not ref.numel():
            continue
        x, y = a[k].double(), ref.double()
        d = float((x - y).abs().max()) / max(float(y.abs().max()), floor)
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
        states = {k: v for k, v in single["states"][step].items() if v.is_floating_point()}
        d, k = _max_rel(multi["states"][step], states)
        if d > rs:
            rs, worst["state"] = d, f"step {step}: {k}"
        ints = [k for k, v in single["states"][step].items() if not v.is_floating_point()]
        if any(not torch.equal(multi["states"][step][k], single["states"][step][k]) for k in ints):
            rs, worst["state"] = float("inf"), f"step {step}: integer state differs"
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


# ---------------------------------------------------------------------------------------------------
# Whole training runs: `unison check --run`
#
# The step check above compares gradients and parameters of a few steps. This one trains the
# real thing — `unison train` (data, augmentation, learning-rate schedule, SyncBN, DDP, logging)
# on the embedded digits data — at 1 worker and at W workers with the same seed and global
# batch, and compares the logged loss curves step by step (``--log-every 1``).
#
# Tolerance. Both runs compute the same mathematics and differ only in floating-point
# summation order (the batch split over ranks, gradients averaged by all-reduce, batch-norm
# statistics combined per rank). In float64 that difference stays at rounding level for the
# whole run. In float32 it does not: some gradients are tiny differences of large terms (the
# bias of a batch norm followed by ReLU -> conv -> batch norm is nearly shift-invariant), so
# float32 evaluates them with relative errors up to 1e-2 (one worker in float32 vs float64
# shows the same), and the curves drift apart by up to a few 1e-2 within a few dozen steps.
# Measured over 25 steps, real bugs show at step 1 already: per-rank batch norm
# (--no-sync-batchnorm) 3.6e-3, local negatives only (--no-gather) 1.5e-1 — no larger than the
# float32 drift later on. Hence two bounds: the first step, before any drift, must agree to
# rounding level in either precision; every step must stay within the drift bound.
# `unison check --run` runs in float64 by default, where one tight bound covers every step.
# ---------------------------------------------------------------------------------------------------

# (bound at step 1, bound at every step) on the relative loss difference. Measured (SimCLR,
# small CNN, digits, global batch 64, 1 vs 2 workers): float64 <= 2e-15 at every step over 200
# steps; float32 1e-7 at step 1, then drifting to 7e-3 by step 25 and 2.5e-2 over 200 steps.
CURVE_TOLERANCE = {"float64": (1e-8, 1e-8), "float32": (1e-5, 5e-2)}


@dataclass
class CurveSpec:
    """Options of ``unison check --run`` (the other `CheckSpec` options map onto the runs as noted)."""

    run: bool = field(default=False, metadata={
        "help": "train whole runs instead (`unison train` on digits) at 1 and --world-size workers, same seed and "
                "global batch, and compare the loss curves step by step (float64: 1e-8 at every step; float32: 1e-5 "
                "at step 1, then a 5e-2 drift bound); --steps/--local-batch/--image-size/--lr apply to the step check "
                "only"})
    run_steps: int = field(default=200, metadata={
        "help": "optimiser steps of each run (--run); the default takes about 2.5 minutes on 2 CPU cores"})
    run_batch_size: int = field(default=64, metadata={"help": "global batch of each run (--run)"})
    run_out: str | None = field(default=None, metadata={
        "help": "keep the run directories (w1/, w2/: metrics.csv, plot.png, ...) here (--run); default: a temporary "
                "directory", "metavar": "DIR"})


@dataclass
class CurvesReport:
    method: str
    world_sizes: tuple[int, ...]
    steps: int
    global_batch: int
    precision: str
    tolerance: tuple[float, float]   # (bound at step 1, bound at every step)
    curves: dict[int, list[float]]   # world size -> loss after each step 1..steps
    rel_diff: list[float]            # per step: max over W of |loss_W - loss_1| / |loss_1|
    knn_top1: dict[int, float]
    wall_s: dict[int, float]
    note: str | None = None

    @property
    def max_rel(self) -> float:
        return max(self.rel_diff) if self.rel_diff else float("inf")

    @property
    def complete(self) -> bool:
        return all(len(c) == self.steps for c in self.curves.values())

    @property
    def passed(self) -> bool:
        first, every = self.tolerance
        return self.complete and bool(self.rel_diff) and self.rel_diff[0] <= first and self.max_rel <= every

    def summary(self) -> str:
        base = self.world_sizes[0]
        lines = [f"unison check --run: method={self.method} world_sizes={','.join(map(str, self.world_sizes))} "
                 f"steps={self.steps} global_batch={self.global_batch} dtype={self.precision} (digits, unison train)"]
        marks = sorted({1, max(1, self.steps // 4), max(1, self.steps // 2), self.steps})
        for w, curve in self.curves.items():
            shown = "  ".join(f"{s}: {curve[s - 1]:.6f}" for s in marks if s <= len(curve))
            lines.append(f"  W={w}: loss at step {shown}   kNN top-1 {self.knn_top1.get(w, float('nan')):.4f}, "
                         f"{self.wall_s.get(w, 0):.0f} s")
        if not self.complete:
            lines.append(f"  a run logged fewer than {self.steps} losses: "
                         + ", ".join(f"W={w}: {len(c)}" for w, c in self.curves.items()))
        if self.rel_diff:
            worst = max(range(len(self.rel_diff)), key=self.rel_diff.__getitem__)
            growth = "  ".join(f"{s}: {self.rel_diff[s - 1]:.1e}" for s in marks if s <= len(self.rel_diff))
            lines.append(f"  relative loss difference vs W={base}, max {self.max_rel:.3e} at step {worst + 1}; "
                         f"at step {growth}")
        if self.note:
            lines.append(f"  not exactly equivalent here: {self.note}")
        first, every = self.tolerance
        bound = f"{every:.0e} per step" if first == every else f"{first:.0e} at step 1, {every:.0e} per step (drift)"
        lines.append(f"  {'PASS' if self.passed else 'FAIL'}: tolerance {bound} ({self.precision})")
        return "\n".join(lines)


def _read_losses(metrics_csv: Path) -> list[float]:
    import csv

    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    by_step = {int(float(r["step"])): float(r["loss"]) for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def run_curves(method: str = "simclr", steps: int = 200, world_sizes: tuple[int, ...] = (1, 2), *,
               batch_size: int = 64, precision: str = "float64", seed: int = 0, backbone: str = "small_cnn",
               data: str = "digits", method_params: dict[str, Any] | None = None, sync_batchnorm: bool = True,
               gather_distributed: bool = True, shared_queue: bool = True,
               tolerance: tuple[float, float] | None = None,
               out: str | None = None, extra_args: tuple[str, ...] = ()) -> CurvesReport:
    """Train `method` with `unison train` at each world size (same seed, same global batch) and compare
    the per-step loss curves against the first world size.

    Runs go through `unison.cli.main` — the user's code path, launcher included — with
    ``--log-every 1``; their directories are kept under `out` (``w1/``, ``w2/``, ...) if given.
    """
    import json
    import tempfile

    from unison.cli import main as cli_main
    from unison.distributed.config import ConfigError
    from unison.methods import get_method

    try:
        cls = get_method(method)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if precision not in CURVE_TOLERANCE:
        raise ConfigError(f"precision must be one of {', '.join(CURVE_TOLERANCE)}, got {precision!r}")
    if steps < 1 or len(world_sizes) < 2:
        raise ConfigError(f"need --run-steps >= 1 and two world sizes, got steps={steps}, world_sizes={world_sizes}")
    bad = [w for w in world_sizes if w < 1 or batch_size % w]
    if bad:
        raise ConfigError(f"--run-batch-size {batch_size} must split evenly over every world size; "
                          f"{', '.join(map(str, bad))} does not divide it")
    common = ["--method", method, "--data", data, "--backbone", backbone, "--batch-size", str(batch_size),
              # --epochs >= steps so that --max-steps decides the length, and the schedule, of both runs
              "--epochs", str(steps), "--max-steps", str(steps), "--log-every", "1",
              "--checkpoint-every", str(steps), "--keep-checkpoints", "1", "--precision", precision,
              # one thread per worker: identical kernels at every W, and no oversubscription
              "--seed", str(seed), "--threads", "1", "--no-progress",
              "--sync-batchnorm" if sync_batchnorm else "--no-sync-batchnorm",
              "--gather" if gather_distributed else "--no-gather",
              "--shared-queue" if shared_queue else "--no-shared-queue"]
    for k, v in (method_params or {}).items():
        common += ["--param", f"{k}={json.dumps(v)}"]  # JSON is YAML, which --param parses
    with tempfile.TemporaryDirectory(prefix="unison-curves-") as tmp:
        root = Path(out) if out else Path(tmp)
        curves: dict[int, list[float]] = {}
        knn: dict[int, float] = {}
        wall: dict[int, float] = {}
        for w in world_sizes:
            run_dir = root / f"w{w}"
            if (run_dir / "metrics.csv").exists():  # never mix with the rows of an earlier run
                (run_dir / "metrics.csv").unlink()
            started, threads = time.perf_counter(), torch.get_num_threads()
            try:
                rc = cli_main(["train", *common, "--world-size", str(w), "--out", str(run_dir), *extra_args])
            finally:
                torch.set_num_threads(threads)  # W=1 trains in this process and set it to --threads
            wall[w] = time.perf_counter() - started
            if rc != 0:  # its own one-line error is already on stderr
                raise ConfigError(f"the run at world size {w} failed (exit status {rc}); see the error above")
            curves[w] = _read_losses(run_dir / "metrics.csv")
            knn[w] = float(json.loads((run_dir / "summary.json").read_text())["knn_top1"])
    ref = curves[world_sizes[0]]
    n = min(len(c) for c in curves.values())
    rel = [max(abs(curves[w][i] - ref[i]) / max(abs(ref[i]), 1e-12) for w in world_sizes[1:]) for i in range(n)]
    note = "gather is off: each rank's loss sees only its local batch" if not gather_distributed else cls.inexact_reason
    if not sync_batchnorm:
        note = "batch norm statistics are per rank (--no-sync-batchnorm)"
    return CurvesReport(method, tuple(world_sizes), steps, batch_size, precision,
                        CURVE_TOLERANCE[precision] if tolerance is None else tolerance, curves, rel, knn, wall, note)


def run_curves_for_check(method: str, check: dict[str, Any], curve: dict[str, Any],
                         method_params: dict[str, Any] | None = None) -> CurvesReport:
    """`unison check --run`: map the `CheckSpec` options the user gave onto `run_curves`."""
    spec = CurveSpec(**{k: v for k, v in curve.items() if k in {f.name for f in dataclasses.fields(CurveSpec)}})
    defaults = CheckSpec()
    return run_curves(method, spec.run_steps, (1, check.get("world_size", defaults.world_size)),
                      batch_size=spec.run_batch_size, precision=check.get("dtype", defaults.dtype),
                      seed=check.get("seed", defaults.seed), backbone=check.get("backbone", defaults.backbone),
                      method_params=method_params,
                      sync_batchnorm=check.get("sync_batchnorm", defaults.sync_batchnorm),
                      gather_distributed=check.get("gather_distributed", defaults.gather_distributed),
                      shared_queue=check.get("shared_queue", defaults.shared_queue), out=spec.run_out)
