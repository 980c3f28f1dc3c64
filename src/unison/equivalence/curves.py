"""`unison check --run`: whole `unison train` runs at 1 and W workers, loss curves compared step by step.

The step check (`unison.equivalence.steps`) compares gradients and parameters of a few steps.
This one trains the real thing — `unison.train` (data, augmentation, learning-rate
schedule, SyncBN, DDP, logging) on the embedded digits data — at 1 worker and at W workers
with the same seed and global batch, logging the loss at every step, and requires the two
curves to agree within `CURVE_TOLERANCE` at every step::

    report = run_curves("simclr", steps=200, world_sizes=(1, 2))   # two whole training runs: minutes on a CPU
    print(report.summary()); assert report.passed
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unison.config.check import CURVE_TOLERANCE, CurveSpec

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
# Real bugs, per-rank batch norm (--no-sync-batchnorm) or local negatives only (--no-gather), show
# at step 1 already, far above rounding level but no larger than the float32 drift later on.
# Hence two bounds: the first step, before any drift, must agree to
# rounding level in either precision; every step must stay within the drift bound.
# `unison check --run` runs in float64 by default, where one tight bound covers every step.
# ---------------------------------------------------------------------------------------------------

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


def run_curves(method: str = "simclr", steps: int = 200, world_sizes: tuple[int, ...] = (1, 2), *,
               batch_size: int = 64, precision: str = "float64", seed: int = 0, backbone: str | None = None,
               data: str = "digits", method_params: dict[str, Any] | None = None, sync_batchnorm: bool = True,
               gather_distributed: bool = True, shared_queue: bool = True,
               tolerance: tuple[float, float] | None = None,
               out: str | None = None) -> CurvesReport:
    """Train `method` with `unison train` at each world size (same seed, same global batch) and compare
    the per-step loss curves against the first world size.

    Runs go through `unison.train` — the user's code path, launcher included — logging every step;
    their directories are kept under `out` (``w1/``, ``w2/``, ...) if given.
    """
    import tempfile

    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.errors import ConfigError, WorkerError
    from unison.methods import METHODS
    from unison.training.run import run_training as train

    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; use one of {', '.join(sorted(METHODS))}")
    cls = METHODS[method]
    if precision not in CURVE_TOLERANCE:
        raise ConfigError(f"precision must be one of {', '.join(CURVE_TOLERANCE)}, got {precision!r}")
    if steps < 1 or len(world_sizes) < 2:
        raise ConfigError(f"need --run-steps >= 1 and two world sizes, got steps={steps}, world_sizes={world_sizes}")
    bad = [w for w in world_sizes if w < 1 or batch_size % w]
    if bad:
        raise ConfigError(f"--run-batch-size {batch_size} must split evenly over every world size; "
                          f"{', '.join(map(str, bad))} does not divide it")
    with tempfile.TemporaryDirectory(prefix="unison-curves-") as tmp:
        root = Path(out) if out else Path(tmp)
        curves: dict[int, list[float]] = {}
        knn: dict[int, float] = {}
        wall: dict[int, float] = {}
        for w in world_sizes:
            run_dir = root / f"w{w}"
            if (run_dir / "metrics.csv").exists():  # never mix with the rows of an earlier run
                (run_dir / "metrics.csv").unlink()
            # --epochs >= steps so that --max-steps decides the length, and the schedule, of both runs; one
            # thread per worker: identical kernels at every W, and no oversubscription. The curves are compared,
            # so neither run measures the random-init kNN or the label-free signals (they train nothing)
            cfg = TrainConfig(method=method, data=data, backbone=backbone, batch_size=batch_size, epochs=steps,
                              max_steps=steps, log_every=1, checkpoint_every=steps, keep_checkpoints=1,
                              random_init_knn=False, signal_images=0,
                              precision=precision, seed=seed, threads=1, progress=False, out=str(run_dir),
                              method_params=dict(method_params or {}),
                              distributed=DistributedConfig(world_size=w, sync_batchnorm=sync_batchnorm,
                                                            gather_distributed=gather_distributed,
                                                            shared_queue=shared_queue))
            started, threads = time.perf_counter(), torch.get_num_threads()
            try:
                summary = train(cfg)
            except WorkerError as exc:
                raise WorkerError(f"the run at world size {w} failed: {exc}") from None
            finally:
                torch.set_num_threads(threads)  # W=1 trains in this process and set it to --threads
            wall[w] = time.perf_counter() - started
            curves[w] = [loss for _, loss in summary.loss_curve]
            knn[w] = float(summary.knn_top1 or 0.0)
    ref = curves[world_sizes[0]]
    n = min(len(c) for c in curves.values())
    rel = [max(abs(curves[w][i] - ref[i]) / max(abs(ref[i]), 1e-12) for w in world_sizes[1:]) for i in range(n)]
    note = "gather is off: each rank's loss sees only its local batch" if not gather_distributed else cls.inexact_reason
    if not sync_batchnorm:
        note = "batch norm statistics are per rank (--no-sync-batchnorm)"
    return CurvesReport(method, tuple(world_sizes), steps, batch_size, precision,
                        CURVE_TOLERANCE[precision] if tolerance is None else tolerance, curves, rel, knn, wall, note)


def check_run_options(check: dict[str, Any]) -> None:
    """The `CheckSpec` options the user gave that ``unison check --run`` cannot pass on to its runs: one line,
    rather than silently left out."""
    from unison.errors import ConfigError

    if check.get("grad_sync_every", 1) != 1 or "accumulation" in check:
        raise ConfigError("unison check --run trains whole runs without accumulation; leave out --grad-sync-every "
                          "and --accumulation, or drop --run to check the accumulated step")
    given = [f"--{k.replace('_', '-')}" for k in ("layer_decay", "freeze") if check.get(k) is not None]
    if given:
        raise ConfigError(f"unison check --run does not take {' or '.join(given)}; drop --run to check the step "
                          "with them")


def run_curves_for_check(method: str, check: dict[str, Any], curve: dict[str, Any],
                         method_params: dict[str, Any] | None = None) -> CurvesReport:
    """`unison check --run`: map the `CheckSpec` options the user gave onto `run_curves`."""
    check_run_options(check)
    spec = CurveSpec(**{k: v for k, v in curve.items() if k in {f.name for f in dataclasses.fields(CurveSpec)}})
    from unison.config.check import CheckSpec
    from unison.config.fields import check_fields

    check_fields(CheckSpec(**check))   # the values given, in the check's own names
    check_fields(spec)
    defaults = CheckSpec()
    return run_curves(method, spec.run_steps, (1, check.get("world_size", defaults.world_size)),
                      batch_size=spec.run_batch_size, precision=check.get("dtype", defaults.dtype),
                      seed=check.get("seed", defaults.seed), backbone=check.get("backbone", defaults.backbone),
                      method_params=method_params,
                      sync_batchnorm=check.get("sync_batchnorm", defaults.sync_batchnorm),
                      gather_distributed=check.get("gather_distributed", defaults.gather_distributed),
                      shared_queue=check.get("shared_queue", defaults.shared_queue), out=spec.run_out)
