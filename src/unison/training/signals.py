"""Seeing a run without labels: the label-free signals, collapse caught early, and the online linear probe.

* The signals (`measure_signals`, which the trainer calls): RankMe, embedding std, alignment and uniformity (their
  definitions below, `all_signals`) on a fixed held-back set of ``--signal-images`` training images (default 512; chosen
  from ``--seed`` only, no labels needed), at the start, every ``--signals-every`` steps (0: every max(50, steps /
  50) steps: one evaluation costs about one training step, so it spends at most one step in 50) and at the end.
  They go to ``metrics.csv``, ``train.log``, the progress bar, TensorBoard/W&B and ``summary.json``.
* Collapse: `COLLAPSE_EVALS` evaluations in a row of `unison.training.collapse.collapsed` (embedding std or RankMe
  too low) -> one warning line (what collapsed, what usually helps); with ``--stop-on-collapse`` the run ends there,
  its checkpoint and summary written like any run's end. Collapse is judged on `MIN_COLLAPSE_IMAGES` (16) held-back
  images or more: below that a healthy network's RankMe already lies under its floor (``--stop-on-collapse`` with
  fewer ``--signal-images`` is refused by the configuration; data with fewer images turns it off, with a warning).
  Non-finite embeddings end the run with their cause (`unison.training.nonfinite`), before RankMe's SVD meets them.
* `OnlineProbe`: with labelled training data (``--online-probe``, on by default), a linear classifier on the
  detached features of the first view of about `PROBE_IMAGES` images of each step (those whose index is a
  multiple of ``global batch / 64``: the same images at any W); its accuracy on each batch before it learns from
  it is logged.

Identical for any world size: the held-back images are embedded in fixed chunks of `CHUNK` images (the same
chunks, so the same arithmetic, at any W), each rank embedding a contiguous run of chunks; the features are
gathered in image order and every rank computes the signals from the same matrix. The two views are the run's
own augmentation drawn at the keys (seed, `SIGNAL_EPOCH`, image index), an epoch no training step reaches, so
they are the same at any W and at every evaluation; a method that trains on one view (mae, ijepa, distill) gets its
second view from a second draw of its augmentation (`SECOND_VIEW_EPOCH`): two views of one image, whose alignment
means what it means for the others (comparing the one view with itself would give 0 at every evaluation). Streamed
data: the held-back images are decoded at the training size (shorter side resized, centre square) before they
are augmented.

The probe standardises the features with their running mean and variance (global sums, momentum
`PROBE_MOMENTUM`): a backbone's raw features can sit at 0.01 +- 0.01, where a plain linear layer learns nothing
in a few hundred steps. It never changes the encoder's training: it reads the features under ``no_grad`` in eval
mode (no batch-norm statistics move), its weights start at zero (no random draws), it has its own optimizer, and
under DDP its small gradient is all-reduced by itself (never through the method's DDP), so it learns the same at any
W. Its state (weights, optimizer, feature statistics and the counts since the last logged accuracy) is in every
checkpoint (``online_probe``, `unison.training.checkpoint.extra_state`): a resumed run reports the accuracy the
uninterrupted one does. Why on by default: it costs one no-grad forward of 64 images per step (a small share of a
step: docs/benchmarks.md measures it) and is the accuracy curve a labelled run otherwise lacks between kNN
evaluations. Why the augmented first view and not an un-augmented image: the view is already on the device in
the step's format for memory and streamed data alike (an un-augmented image of streamed data would be decoded
again), as solo-learn's and Lightly's online classifiers do.

The signals of an embedding matrix (`rankme`, `embedding_std`, `alignment`, `uniformity`: plain tensors in, floats
out). With ``Z`` the ``[N, d]`` embeddings of N images (rows), ``z_i = Z_i / ||Z_i||`` the L2-normalised rows, and
``(x_i, y_i)`` the normalised embeddings of two augmented views of image i:

* **RankMe** (Garrido et al., "RankMe: Assessing the downstream performance of pretrained self-supervised
  representations by their rank", ICML 2023, eq. 1): with ``s_k`` the singular values of ``Z`` (unnormalised,
  as in the paper), ``p_k = s_k / sum_j s_j + eps`` (eps = 1e-7, the paper's) and
  ``RankMe = exp(-sum_k p_k log p_k)``: the effective rank, between 1 (every image on one line) and
  ``min(N, d)`` (a flat spectrum). `rankme`.
* **Embedding std** (Chen & He, "Exploring simple Siamese representation learning", CVPR 2021, §4.1, the
  collapse indicator; VICReg's variance term watches the same quantity): ``std_d(z)``, the standard deviation
  over the N images of each dimension of the normalised embeddings, averaged over the d dimensions. For
  embeddings spread uniformly over the unit sphere it is ``1/sqrt(d)``; for a collapsed (constant) embedding
  it is 0. `embedding_std` returns it times ``sqrt(d)``, so 1 means healthy and 0 collapsed whatever d is.
* **Alignment** and **uniformity** (Wang & Isola, "Understanding contrastive representation learning through
  alignment and uniformity on the hypersphere", ICML 2020, with their alpha = 2, t = 2):
  ``align = mean_i ||x_i - y_i||^2`` (0 = the two views embed identically; a collapsed encoder also gives 0)
  and ``uniform = log mean_{i<j} exp(-2 ||x_i - x_j||^2)``, averaged over the two views
  (down to about -4 on a 128-d sphere: lower is more uniform; 0 = every image in one point).

Everything is computed in float64 on the whole matrix, so every rank that holds the same matrix gets the
same numbers (`measure_signals` gathers it in a world-size-independent order).

Example::

    z = torch.randn(512, 64)
    rankme(z), embedding_std(z)           # about 55 (of 64) and about 1.0
    alignment(z, z), uniformity(z)        # 0.0 and about -3.9
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from unison.distributed import collectives as C
from unison.errors import CheckpointError, NonFiniteLossError
from unison.rng import epoch_permutation
from unison.training.nonfinite import non_finite_cause
from unison.training.step import Batch, Run

CHUNK = 64                  # images per embedding call: the same chunks at any world size
SIGNAL_EPOCH = 2**61        # the augmentation key of the two views: past any training epoch (at most 1e9)
SECOND_VIEW_EPOCH = SIGNAL_EPOCH + 1   # ... and of the second view of a one-view method, an independent draw
AUTO_EVALUATIONS = 50       # --signals-every 0: about this many evaluations in a long run,
AUTO_MIN_EVERY = 50         # and at most one every 50 steps (one evaluation costs about one step at batch 256)
PROBE_IMAGES = 64           # the probe learns from about this many images of each step (index % stride == 0)
PROBE_MOMENTUM = 0.5        # of the running feature statistics the probe standardises with
PROBE_LR = 3e-2             # Adam on the probe's weights
RANKME_EPS = 1e-7           # Garrido et al. 2023, eq. 1
UNIFORMITY_T = 2.0          # Wang & Isola 2020
ALIGNMENT_ALPHA = 2


# ---- the signals of an embedding matrix

def rankme(z: torch.Tensor, eps: float = RANKME_EPS) -> float:
    """exp of the entropy of the L1-normalised singular values of `z` [N, d] (module docstring)."""
    s = torch.linalg.svdvals(z.double())
    p = s / s.sum().clamp_min(torch.finfo(torch.float64).tiny) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def embedding_std(z: torch.Tensor) -> float:
    """sqrt(d) x the mean over dimensions of the per-dimension std of the L2-normalised rows of `z` [N, d]."""
    zn = F.normalize(z.double(), dim=1)
    return float(zn.std(dim=0, correction=0).mean() * math.sqrt(z.shape[1]))


def alignment(x: torch.Tensor, y: torch.Tensor, alpha: int = ALIGNMENT_ALPHA) -> float:
    """mean ||x_i - y_i||^alpha of the L2-normalised rows of two views `x`, `y` [N, d]."""
    xn, yn = F.normalize(x.double(), dim=1), F.normalize(y.double(), dim=1)
    return float((xn - yn).norm(dim=1).pow(alpha).mean())


def uniformity(x: torch.Tensor, t: float = UNIFORMITY_T) -> float:
    """log mean_{i<j} exp(-t ||x_i - x_j||^2) of the L2-normalised rows of `x` [N, d] (N >= 2)."""
    xn = F.normalize(x.double(), dim=1)
    sq = torch.pdist(xn, p=2).pow(2)
    if sq.numel() == 0:
        return 0.0
    # log-mean-exp, stable: the largest term is exp(0) at most
    return float(torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel()))


def all_signals(eval_view: torch.Tensor, view_a: torch.Tensor, view_b: torch.Tensor) -> dict[str, float]:
    """The four signals: RankMe and std of the un-augmented embeddings, alignment and uniformity of two views."""
    return {"rankme": rankme(eval_view), "emb_std": embedding_std(eval_view),
            "align": alignment(view_a, view_b), "uniform": (uniformity(view_a) + uniformity(view_b)) / 2}


# ---- measured on the run's held-back images

def _cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().cpu()


def held_back_indices(num_images: int, count: int, seed: int) -> np.ndarray:
    """`count` training-image indices (sorted), a function of the seed only: the signals' fixed set."""
    chosen = epoch_permutation(num_images, SIGNAL_EPOCH, seed)[:min(count, num_images)]
    return np.sort(chosen.numpy())


def _chunks_of_rank(n: int) -> tuple[range, int]:
    """(this rank's chunk numbers, the embedding calls of the busiest rank): contiguous runs of chunks."""
    chunks = math.ceil(n / CHUNK)
    mine = C.contiguous_share(chunks, C.rank(), C.world_size())
    return range(mine.start, mine.stop), math.ceil(chunks / C.world_size())


@torch.no_grad()
def _embed_gathered(run: Run, n: int, inputs: Callable[[int], list[torch.Tensor]]) -> list[torch.Tensor]:
    """For each of the model inputs `inputs(chunk)` gives (the chunk's images ``chunk*CHUNK ..``), the features
    [n, d] of all n images (float32, unnormalised), in order, on every rank. Every rank embeds its chunks; one with
    fewer embeds chunk 0 again (discarded): a sharded encoder's collectives need every rank to call it equally often."""
    mine, calls = _chunks_of_rank(n)
    feats: list[list[torch.Tensor]] = [[run.method.embed(x).float().flatten(1) for x in inputs(c)] for c in mine]
    widths = [f.shape[1] for f in feats[0]] if feats else []
    for _ in range(len(feats), calls):
        widths = [run.method.embed(x).flatten(1).shape[1] for x in inputs(0)]
    out = []
    for k, width in enumerate(widths):
        local = torch.cat([f[k] for f in feats]) if feats else torch.zeros(0, width, device=run.device)
        out.append(C.gather_no_grad(local, uneven=True))
    return out


class HeldBack:
    """The fixed held-back images and what the signals embed of each: its un-augmented eval view and two augmented
    views (the same at every evaluation: kept, up to `CACHE_BYTES` per rank, else made again each time)."""

    CACHE_BYTES = 128 * 2**20

    def __init__(self, run: Run, count: int):
        self.run = run
        self.indices = held_back_indices(run.data.num_images, count, run.cfg.seed)
        self.images = run.data.images_at(self.indices, run.device)   # uint8 tensor, or decoded per chunk (stream)
        self.keys = torch.from_numpy(self.indices).to(run.device)
        self.cache: dict[int, list[torch.Tensor]] = {}
        self.cached_bytes = 0

    def __len__(self) -> int:
        return len(self.indices)

    def inputs(self, chunk: int) -> list[torch.Tensor]:
        """[eval view, view 0, view 1] of the images of `chunk`, in the run's dtype and memory format."""
        if chunk in self.cache:
            return self.cache[chunk]
        run, a, b = self.run, chunk * CHUNK, min(len(self), (chunk + 1) * CHUNK)
        # streamed: decoded now; an unreadable image stays black (its place fixed, so every W sees the same set)
        images = self.images[a:b] if isinstance(self.images, torch.Tensor) else self.images.decode(a, b)[0]
        views = run.augment(images, self.keys[a:b], SIGNAL_EPOCH, run.cfg.seed)
        if len(views) == 1:   # one-view methods (mae, ijepa, distill): a second draw of their augmentation
            views = [views[0], run.augment(images, self.keys[a:b], SECOND_VIEW_EPOCH, run.cfg.seed)[0]]
        made = [run.to_eval(images), *(self._format(v) for v in views[:2])]
        size = sum(x.numel() * x.element_size() for x in made)
        if self.cached_bytes + size <= self.CACHE_BYTES:
            self.cache[chunk], self.cached_bytes = made, self.cached_bytes + size
        return made

    def _format(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.run.dtype)
        return x.contiguous(memory_format=torch.channels_last) if self.run.cfg.nhwc else x


def measure_signals(run: Run, held: HeldBack, step: int) -> dict[str, float]:
    """The signals of the encoder at `step` (collective: every rank calls it, every rank gets the same values).
    Non-finite embeddings end the run (`NonFiniteLossError`, on every rank alike) with their cause."""
    was_training = run.method.training
    run.method.eval()
    try:
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast_dtype is torch.bfloat16):
            z, a, b = _embed_gathered(run, len(held), held.inputs)
    finally:
        run.method.train(was_training)
    if not all(bool(torch.isfinite(x).all()) for x in (z, a, b)):   # the SVD of RankMe would fail on them
        cause = non_finite_cause(run.method, held.inputs(0), run.cfg, step)
        raise NonFiniteLossError(f"non-finite embeddings of the held-back images (--signal-images) at step {step}; "
                                 f"{cause}" + (" (the last checkpoint is intact)" if step else ""))
    out = all_signals(z, a, b)
    out["rankme_max"] = float(min(z.shape))
    return out


class OnlineProbe:
    """The online linear probe (module docstring): it sees each step's first micro-batch (`see`), learns from it
    after the step (`learn`), and its accuracy is logged with the metrics (`accuracy`)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.enabled = run.cfg.online_probe and run.data.labelled
        self.classes = run.data.num_classes
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.mean: torch.Tensor | None = None   # running feature statistics (float64, from global sums)
        self.var: torch.Tensor | None = None
        self.pending: Batch | None = None
        self.counts = torch.zeros(2, dtype=torch.float64, device=run.device)   # correct, seen since `accuracy`
        self.stride = max(1, run.global_batch * run.accumulate // PROBE_IMAGES)
        self.train_s = 0.0

    def see(self, batch: Batch) -> None:
        if self.enabled and batch.micro == 0:
            self.pending = batch   # the step's first micro-batch: its first view is probed after the step

    def learn(self) -> None:
        """One probe step on the step's pending micro-batch (none: nothing to learn)."""
        if self.pending is None:
            return
        started = time.perf_counter()
        batch, self.pending = self.pending, None
        self._learn(self.run, batch)
        self.train_s += time.perf_counter() - started

    def _learn(self, run: Run, batch: Batch) -> None:
        """One probe step on the step's images whose index is a multiple of `stride` (the same images at any W)."""
        idx = batch.indices.to(run.device)
        chosen = idx % self.stride == 0
        rows = chosen if bool(chosen.any()) else torch.arange(len(idx), device=run.device) == 0   # embed >= 1 image:
        with torch.no_grad():                                           # a sharded encoder's collectives need it
            was_training = run.method.training
            run.method.eval()
            try:
                with torch.autocast(run.device.type, dtype=torch.bfloat16,
                                    enabled=run.autocast_dtype is torch.bfloat16):
                    feats = run.method.embed(batch.views[0][rows]).float().flatten(1)
            finally:
                run.method.train(was_training)
        labels = run.data.labels_at(idx[rows])
        keep = chosen[rows] & (labels >= 0)
        feats, labels = feats[keep].double(), labels[keep]
        sums = torch.cat([feats.sum(0), feats.square().sum(0), torch.ones(1, device=run.device,
                                                                          dtype=torch.float64) * len(feats)])
        if self.weight is None:   # zeros: a convex problem needs no random start, and draws nothing
            self._start(run, C.all_reduce_no_grad(sums))
        assert self.weight is not None and self.bias is not None and self.optimizer is not None
        assert self.mean is not None and self.var is not None
        # standardised with the features' running statistics (the raw features' scale is the backbone's own)
        logits = F.linear(((feats - self.mean) / (self.var + 1e-12).sqrt()).float(), self.weight, self.bias)
        self.optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(logits, labels, reduction="sum").backward()   # this rank's sum; averaged below
        assert self.weight.grad is not None and self.bias.grad is not None
        correct = (logits.detach().argmax(1) == labels).sum().double()
        # one all-reduce of the probe's own gradient, feature sums and counts (never through the method's DDP)
        flat = C.all_reduce_no_grad(torch.cat([self.weight.grad.flatten().double(), self.bias.grad.double(),
                                               sums, correct[None]]))
        seen, nw, d = flat[-2].clamp_min(1), self.weight.numel(), self.mean.numel()
        self.weight.grad.copy_((flat[:nw] / seen).view_as(self.weight))
        self.bias.grad.copy_(flat[nw:nw + self.classes] / seen)
        self.optimizer.step()
        mean, square = flat[-2 - 2 * d:-2 - d] / seen, flat[-2 - d:-2] / seen
        self.mean.mul_(PROBE_MOMENTUM).add_(mean, alpha=1 - PROBE_MOMENTUM)
        self.var.mul_(PROBE_MOMENTUM).add_((square - mean.square()).clamp_min(0), alpha=1 - PROBE_MOMENTUM)
        self.counts += torch.stack([flat[-1], flat[-2]])

    def _start(self, run: Run, sums: torch.Tensor) -> None:
        """The probe's weights (zeros), optimizer, and feature statistics from the first step's global sums."""
        d = (len(sums) - 1) // 2
        seen = sums[-1].clamp_min(1)
        self.mean = sums[:d] / seen
        self.var = (sums[d:2 * d] / seen - self.mean.square()).clamp_min(0)
        self.weight = torch.zeros(self.classes, d, device=run.device, requires_grad=True)
        self.bias = torch.zeros(self.classes, device=run.device, requires_grad=True)
        self.optimizer = torch.optim.Adam([self.weight, self.bias], lr=PROBE_LR)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries of the probe (plain tensors; None before its first step)."""
        if self.weight is None or self.optimizer is None:
            return {"weight": None, "counts": self.counts.detach().cpu()}
        return {"weight": self.weight.detach().cpu(), "bias": self.bias.detach().cpu() if self.bias is not None
                else None, "mean": _cpu(self.mean), "var": _cpu(self.var), "counts": self.counts.detach().cpu(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The probe as the checkpoint left it; one that does not fit this run's classes starts fresh."""
        from unison.training.checkpoint.contents import check_optimizer_state  # what a resume reads is checked

        counts = state.get("counts") if isinstance(state, dict) else None
        if not (isinstance(counts, torch.Tensor) and counts.shape == (2,)):
            raise CheckpointError("the checkpoint's online_probe state is malformed; the file is damaged")
        self.counts = counts.to(self.run.device, torch.float64)
        weight = state.get("weight")
        if weight is None:
            return
        fits = (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[0] == self.classes
                and all(isinstance(state.get(k), torch.Tensor) and state[k].shape == (weight.shape[1],)
                        for k in ("mean", "var")) and isinstance(state.get("bias"), torch.Tensor)
                and isinstance(state.get("optimizer"), dict))
        if not fits:
            warnings.warn("the checkpoint's online probe does not fit this run's classes; it starts fresh",
                          RuntimeWarning, stacklevel=2)
            return
        device = self.run.device
        self.weight = weight.to(device, torch.float32).clone().requires_grad_(True)
        self.bias = state["bias"].to(device, torch.float32).clone().requires_grad_(True)
        self.mean, self.var = state["mean"].to(device, torch.float64), state["var"].to(device, torch.float64)
        self.optimizer = torch.optim.Adam([self.weight, self.bias], lr=PROBE_LR)
        check_optimizer_state(self.optimizer, state["optimizer"], "(its online probe)")
        params = (self.weight, self.bias)
        for i, entry in state["optimizer"]["state"].items():   # Adam's moments: exactly their parameter's shape
            if any(k != "step" and isinstance(v, torch.Tensor) and v.shape != params[i].shape for k, v in entry.items()):
                raise CheckpointError("the checkpoint's online probe has optimizer state that does not fit its weights; "
                                      "the file is damaged")
        self.optimizer.load_state_dict(state["optimizer"])

    def accuracy(self) -> float | None:
        """The probe's accuracy on the batches since the last call (each predicted before it learnt from it)."""
        if not self.enabled or self.counts[1] == 0:
            return None
        acc = float(self.counts[0] / self.counts[1])   # one host sync per logged step
        self.counts.zero_()
        return acc
