"""The training loop's own hooks, one concern each, in the order they run after every optimiser step.

* `LogHook`: metrics (the loss averaged over ranks, learning rate, images/s, data-wait share) every
  ``--log-every`` steps, at the end of every epoch and on the first and last step of an attempt, to
  the metrics logger, ``train.log`` and the progress bar; `DataWaitWarning` when the step starves.
* `UnreadableImagesHook`: training images skipped as unreadable, reported once over the ranks.
* `KnnEvalHook`: kNN top-1 every ``--eval-every`` epochs (the last step excepted), and at the end
  of the run (`KnnEvalHook.final`).
* `CheckpointHook`: when to save (every ``--checkpoint-every`` steps or seconds, else every epoch; the last
  step is saved by the end of the run, `CheckpointHook.final`) and `save_run_checkpoint`.
* `StopHook`: after every step but the last, the ranks agree whether to stop (preemption signals,
  a failed background save: `unison.training.preemption`); a stop saves and raises `Preempted`.

They are `TrainHook`s like any other (`unison.training.hooks`); the loop builds them and adds the
extra hooks after them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from unison.config.fields import count
from unison.config.train import checkpoint_cadence
from unison.distributed import collectives as C
from unison.distributed.signals import stop_requests
from unison.distributed.watchdog import Watchdog
from unison.eval.knn import knn_accuracy
from unison.training.checkpoint import Checkpointer, latest_checkpoint, save_run_checkpoint
from unison.training.hooks import StepEnd, TrainHook
from unison.training.metrics import MetricsLogger
from unison.training.preemption import StopAgreement, preempted, save_failed_elsewhere
from unison.training.progress_bar import progress_bar
from unison.training.runlog import RunLog
from unison.training.step import Batch, Run


class DataWaitWarning:
    """Warn once when the step waits for data more than `SHARE` of a logging window (the first excepted:
    loader processes are still starting), with what to change."""

    SHARE = 0.25

    def __init__(self, run: Run):
        self.run, self.windows, self.warned = run, 0, False

    def observe(self, step: int, share: float) -> None:
        self.windows += 1
        if self.warned or self.windows == 1 or share <= self.SHARE:
            return
        if self.run.data.mode == "memory" and self.run.device.type == "cuda":
            # The views are made by queued kernels: the host's time making a batch includes its waits for the
            # queue (full of the previous step's kernels), so it does not show that augmentation is slow (an H100
            # speed run "waited" 51 %, which says nothing of the augmentation's own time). unison bench times it.
            return
        self.warned = True
        d = self.run.data
        workers = getattr(d.source, "loader_workers", 0)
        advice = (f"raise --loader-workers (now {workers}) or use --decode gpu" if d.mode == "stream" else
                  f"your dataset and transform are the bottleneck: raise loader_workers (now {workers})"
                  if d.mode == "own" else "the in-memory augmentation is the bottleneck (see unison bench)")
        print(f"unison: warning: the training step waited for data {share:.0%} of the time up to step {step} "
              f"(more than {self.SHARE:.0%}); {advice}", file=sys.stderr, flush=True)


class LogHook(TrainHook):
    """Metrics, ``train.log`` lines and the progress bar; keeps what the run's `Summary` reports of them."""

    def __init__(self, run: Run, logger: MetricsLogger, runlog: RunLog, start_step: int, *, probe: Any = None,
                 signals: Any = None) -> None:
        master = C.rank() == 0
        self.run, self.logger, self.runlog = run, logger, runlog
        self.probe, self.signals = probe, signals   # `ProbeHook`, `SignalsHook`: their values join the log lines
        self.probe_top1: float | None = None
        self.first_step = start_step + 1   # logged too, so the loss shows from the first step on
        self.progress = (progress_bar(run.total_steps, start_step, f"{run.cfg.method} x{C.world_size()}")
                         if master and run.cfg.progress else None)
        self.waits = DataWaitWarning(run) if master else None
        self.final_loss = float("nan")
        self.curve: list[tuple[int, float]] = []   # (step, loss) of every logged step, for `Summary.loss_curve`
        self.log_times: list[float] = []
        self.wait_s = self.wait_since_log = self.train_time_s = 0.0
        self.images_since_log = 0
        self.t_start = self.t_log = time.perf_counter()

    def start(self, run: Run, step: int) -> None:
        self.t_start = self.t_log = time.perf_counter()

    def on_batch(self, run: Run, batch: Batch) -> None:
        self.wait_s += batch.wait_s
        self.wait_since_log += batch.wait_s

    def after_step(self, run: Run, end: StepEnd) -> None:
        self.images_since_log += run.global_batch * run.accumulate
        step = end.step
        if step % run.cfg.log_every == 0 or end.last or end.epoch_done or step == self.first_step:
            self._log(end)
        if self.progress is not None:
            self.progress.total = run.total_steps   # a budgeted run plans its length again after its warm-up
            self.progress.update(1)

    def _log(self, end: StepEnd) -> None:
        run, step = self.run, end.step
        self.final_loss = float(C.all_reduce_no_grad(end.loss, average=True))
        self.curve.append((step, self.final_loss))
        self.log_times.append(time.perf_counter() - self.t_start)
        now = time.perf_counter()
        ips = self.images_since_log / max(now - self.t_log, 1e-9)
        data_wait = min(1.0, self.wait_since_log / max(now - self.t_log, 1e-9))   # this rank's share of the window
        self.t_log, self.images_since_log, self.wait_since_log = now, 0, 0.0
        probe = self.probe.accuracy() if self.probe is not None else None
        self.probe_top1 = probe if probe is not None else self.probe_top1
        self.logger.log(step=step, epoch=step / run.steps_per_epoch, loss=self.final_loss, lr=end.lr,
                        images_per_s=ips, data_wait=round(data_wait, 4), probe_top1=probe, world_size=C.world_size())
        latest = self.signals.latest if self.signals is not None else {}
        if self.progress is not None:   # most important first: a narrow terminal drops the last ones
            bar = {"loss": f"{self.final_loss:.4f}", "img/s": f"{ips:.0f}"}
            if probe is not None:
                bar["probe"] = f"{probe:.2f}"
            if latest:   # the signals' last RankMe and std
                bar.update(RankMe=f"{latest['rankme']:.1f}", std=f"{latest['emb_std']:.2f}")
            self.progress.show({**bar, "data wait": f"{data_wait:.0%}"})
        shown = f", online probe {probe:.3f}" if probe is not None else ""
        self.runlog.line(f"step {step}/{run.total_steps} (epoch {step / run.steps_per_epoch:.2f}): loss "
                         f"{self.final_loss:.4f}, lr {end.lr:.4g}, {ips:.0f} img/s{shown}")
        if self.waits is not None:
            self.waits.observe(step, data_wait)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.train_time_s = time.perf_counter() - self.t_start


def knn_batch(run: Run) -> int:
    """Images per forward pass of the kNN: this rank's share of a training batch, 64 to 512. Why: the no-grad
    activations of a larger pass raised the peak memory above training's own, and more so the more images the
    reference set held (a 300-image share at 600 images, 512 at 6,000: +29 % peak RSS)."""
    return max(64, min(512, run.global_batch // max(1, C.world_size())))


def knn_top1(run: Run, backbone: torch.nn.Module | None = None) -> float | None:
    """Weighted kNN top-1 of the encoder on the run's kNN sets (training images as reference, held-out
    images as queries); None when there are none (`run.data.knn_skipped` says why). `backbone`: embed with this
    one in the method's place (the method's own embedding of it: a ViT method's mean patch token, ...), e.g. the
    random-initialisation encoder of a run started from ``--init`` (`Run.random_backbone`)."""
    knn = run.data.knn
    if knn is None:
        return None
    method = run.method
    was_training = method.training
    method.eval()
    with contextlib.ExitStack() as stack:
        if backbone is not None:
            stack.enter_context(_backbone_swapped(method, backbone.to(run.device).eval()))
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast_dtype is torch.bfloat16):
            acc = knn_accuracy(method.embed, knn.reference, knn.reference_labels, knn.queries, knn.query_labels,
                               run.to_eval, knn.num_classes, k=run.cfg.knn_k, t=run.cfg.knn_t,
                               batch_size=knn_batch(run))
    method.train(was_training)
    return acc


@contextlib.contextmanager
def _backbone_swapped(method: torch.nn.Module, backbone: torch.nn.Module) -> Iterator[None]:
    """`method.backbone` is `backbone` inside the block, its own again after it (also on an error). Why a swap and
    not a second method: the method's embedding (class token, mean patch token, dense features) stays the one
    place that says how the method embeds, and nothing of the method is copied."""
    own = method.backbone
    method.backbone = backbone
    try:
        yield
    finally:
        method.backbone = own


def evaluation_cost(run: Run, step: int, baseline: bool) -> str | None:
    """A line saying what the kNN evaluation will cost when it embeds more images than the run trains on from
    `step` (a smoke run of a few steps on real data: minutes of evaluation), with the flags that skip or bound it;
    None otherwise. `baseline`: the random-initialisation kNN runs too (and, with ``--init``, the kNN of the
    starting weights)."""
    knn, per_epoch, every = run.data.knn, run.steps_per_epoch, run.cfg.eval_every
    if knn is None:
        return None
    during = ((run.total_steps - 1) // per_epoch) // every - (step // per_epoch) // every if every else 0
    baselines = (2 if run.random_backbone is not None else 1) if baseline else 0
    times = baselines + max(0, during) + 1
    reference, queries = len(knn.reference_labels), len(knn.query_labels)
    embedded = times * (reference + queries)
    trained = (run.total_steps - step) * run.global_batch * run.accumulate
    if embedded <= trained:
        return None
    when = ("before training and at the end" if times == 2 and baseline else
            "at the end" if times == 1 else f"{times} times")
    return (f"the kNN evaluation embeds {reference:,} reference and {queries:,} held-out images {when}: "
            f"{embedded:,} images, more than the {trained:,} this run trains on ({count(run.total_steps - step, 'step')}); "
            "--no-knn skips it (a smoke run), --no-random-init-knn only the baseline, --subset/--val-subset make the "
            "sets smaller")


class UnreadableImagesHook(TrainHook):
    """Training images skipped as unreadable (``--on-corrupt skip``), reported once over all ranks.

    In memory every rank decodes all the images, and streamed each rank meets a file in whichever epoch its slice
    holds it: a warning per rank named the same file once per worker, and nothing recorded it. Here the ranks add
    up how many they found (one integer all-reduced, at every logged step, the end of each epoch and the start);
    when that changed, they exchange the new names, and rank 0 names the first `NAMED` files (then a count every
    100 more) on standard error and in ``train.log``. At the end: one line with the total, in both, and the count
    for ``summary.json`` (`total`)."""

    NAMED = 3

    def __init__(self, run: Run, runlog: RunLog) -> None:
        self.run, self.runlog = run, runlog
        self.found: dict[str, str] = {}   # over all ranks (on every rank alike): name -> why, in the order found
        self.shared: set[str] = set()     # this rank's names already exchanged
        self.counted = 0                  # the ranks' summed counts at the last exchange

    @property
    def total(self) -> int:
        return len(self.found)

    def start(self, run: Run, step: int) -> None:
        self.exchange()

    def after_step(self, run: Run, end: StepEnd) -> None:
        if end.step % run.cfg.log_every == 0 or end.epoch_done or end.last:
            self.exchange()

    def exchange(self) -> None:
        """Every rank: learn the files the ranks found since the last exchange; rank 0 reports them."""
        mine = self.run.data.unreadable()
        counted = int(C.all_reduce_no_grad(torch.tensor([len(mine)], dtype=torch.int64, device=self.run.device)))
        if counted == self.counted:
            return
        self.counted = counted
        new = [(name, why) for name, why in mine.items() if name not in self.shared]
        self.shared.update(name for name, _ in new)
        for name, why in (item for found in C.all_gather_object(new) for item in found):
            if name not in self.found:
                self.found[name] = why
                self._said(self.total, name, why)

    def _said(self, k: int, name: str, why: str) -> None:
        if k <= self.NAMED:
            self._line(f"warning: skipped unreadable training image {name} ({why}); its views come from the next "
                       "readable image (--on-corrupt skip)" if self.run.data.mode == "stream" else
                       f"warning: skipped unreadable training image {name} ({why}); it is left out (--on-corrupt skip)")
        elif k == self.NAMED + 1 or k % 100 == self.NAMED + 1:
            self._line(f"warning: {k} unreadable training images skipped so far")

    def final(self) -> None:
        """The end of the run: the last exchange, and one line with the total over all ranks when there are any."""
        self.exchange()
        if self.found:
            names = list(self.found)
            shown = ", ".join(names[:self.NAMED]) + (f" and {len(names) - self.NAMED} more" if len(names) > self.NAMED
                                                      else "")
            self._line(f"{count(self.total, 'unreadable training image')} skipped in this run (--on-corrupt skip, "
                       f"over {count(C.world_size(), 'worker')}): {shown}")

    def _line(self, text: str) -> None:
        if C.rank() == 0:
            print(f"unison: {text}", file=sys.stderr, flush=True)
            self.runlog.line(text)


class KnnEvalHook(TrainHook):
    """kNN top-1 every ``--eval-every`` epochs (not on the last step: `final` evaluates it)."""

    def __init__(self, run: Run, watch: Watchdog, logger: MetricsLogger, runlog: RunLog) -> None:
        self.run, self.watch, self.logger, self.runlog = run, watch, logger, runlog

    def after_step(self, run: Run, end: StepEnd) -> None:
        every, epoch = run.cfg.eval_every, end.step // run.steps_per_epoch
        if not (end.epoch_done and every and epoch % every == 0 and not end.last and run.data.knn is not None):
            return
        with self.watch.phase("eval", end.step):
            acc = knn_top1(run)
        self.logger.log(step=end.step, epoch=float(epoch), knn_top1=acc)
        if acc is not None:
            self.runlog.line(f"epoch {epoch}: kNN top-1 {acc:.4f}")

    def final(self, step: int, history: dict[str, Any]) -> None:
        """The end of the run: kNN top-1 into ``history["knn_top1"]``, the metrics and ``train.log``."""
        with self.watch.phase("eval", step):
            history["knn_top1"] = knn_top1(self.run)
        self.logger.log(step=step, epoch=step / self.run.steps_per_epoch, knn_top1=history["knn_top1"])
        if history["knn_top1"] is not None:
            self.runlog.line(f"step {step}: kNN top-1 {history['knn_top1']:.4f}")


class CheckpointHook(TrainHook):
    """When to save: every ``--checkpoint-every`` steps or seconds, else at the end of every epoch, the last step
    excepted. A time-based save is decided by rank 0's clock and broadcast (one int per step), so every rank saves
    at the same step."""

    def __init__(self, run: Run, checkpointer: Checkpointer, watch: Watchdog, history: dict[str, Any]) -> None:
        self.run, self.checkpointer, self.watch, self.history = run, checkpointer, watch, history
        self.cadence = checkpoint_cadence(run.cfg.checkpoint_every)
        self.last_save = time.monotonic()

    def _due(self, end: StepEnd) -> bool:
        if self.cadence.steps:
            return end.step % self.cadence.steps == 0
        if not self.cadence.seconds:
            return end.epoch_done
        due = torch.tensor([int(time.monotonic() - self.last_save >= self.cadence.seconds)], device=self.run.device)
        return bool(C.broadcast_(due, src=0).item())   # rank 0 decides: every rank joins the same save

    def after_step(self, run: Run, end: StepEnd) -> None:
        end.saved = self._due(end) and not end.last
        if end.saved:
            with self.watch.phase("checkpoint", end.step):
                save_run_checkpoint(run, self.checkpointer, end.step, self.history)
            self.last_save = time.monotonic()

    def final(self, step: int) -> None:
        """The end of the run: the last checkpoint, complete on disk before the run returns."""
        with self.watch.phase("checkpoint", step):
            save_run_checkpoint(self.run, self.checkpointer, step, self.history)
            self.checkpointer.wait()


class StopHook(TrainHook):
    """After every step but the last: agree with the other ranks whether to stop; on a stop request save (unless
    this step was just saved) and raise `Preempted`. A failed background save ends the run with its error (rank 0)
    on every rank."""

    def __init__(self, run: Run, checkpointer: Checkpointer, watch: Watchdog, history: dict[str, Any],
                 out_of_time: Callable[[], bool] = lambda: False) -> None:
        self.run, self.checkpointer, self.watch, self.history = run, checkpointer, watch, history
        self.out_of_time = out_of_time   # a --time-budget run's clock (rank 0's decides: `unison.training.budget`)
        self.agreement = StopAgreement()   # collective: every rank builds it at the same point

    def after_step(self, run: Run, end: StepEnd) -> None:
        if end.last:   # the last step goes on to the final checkpoint anyway
            return
        step, checkpointer = end.step, self.checkpointer
        with self.watch.phase("collective", step):
            decision = self.agreement.exchange(stop_requests(), checkpointer.failed(), self.out_of_time())
        if decision.out_of_time and not decision.stop:   # the budget's end: the normal end of the run follows
            end.stop = True
            return
        if decision.save_failed:
            checkpointer.raise_if_failed()     # rank 0: the save's own error
            raise save_failed_elsewhere()
        if not decision.stop:
            return
        with self.watch.phase("checkpoint", step):
            if not end.saved:
                save_run_checkpoint(run, checkpointer, step, self.history)
            path = checkpointer.wait()         # the preemption checkpoint is complete before anyone exits
            if path is None and C.rank() == 0:   # --shard full: written by every rank through DCP
                path = latest_checkpoint(checkpointer.run_dir)
            C.barrier()
        raise preempted(decision, step, run.total_steps, str(path) if path is not None else None)

    def close(self) -> None:
        self.agreement.close()   # the exchange in flight, before the process group goes away
