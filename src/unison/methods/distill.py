"""Distillation of a frozen pretrained teacher into a student of any backbone (LightlyTrain's ``distillation``).

The objective of LightlyTrain 0.17.0 (``lightly-ai/lightly-train``, ``src/lightly_train/_methods/distillationv3/
distillationv3.py`` and ``distillationv3_loss.py``: ``DistillationV3``, what ``method="distillation"`` maps to;
written here from its description, not copied). One augmented view x per image, mixed up, then

    teacher (frozen, eval, no grad):  t = normalize(pool(T(x))) [B, Dt],  T_j = normalize(map(T(x))_j) [B, N, Dt]
    student:                          s = normalize(g(pool(S(x)))),       S_j = normalize(resize(l(map(S(x))))_j)
    queue Q [q, Dt] <- the global batch's t, newest first (before the loss, as theirs)
    global = KL( softmax(t Q^T / tau_g) || softmax(s Q^T / tau_g) )       (tau_g = 0.07, per image)
    local  = KL( softmax(T_j T^T / tau_l) || softmax(S_j S^T / tau_l) )    (tau_l = 0.07, per patch j of an image)
    loss   = mean over images of global + local_weight * mean over patches of local

g, l: linear layers from the student's width to the teacher's (weights trunc-normal, std 0.02); map(S(x)) is
the student's feature map (`unison.models.dense`), projected by l location by location and resized bilinearly
to the teacher's patch grid; pool is the class token of a ViT teacher (the spatial mean of a CNN's map).
Mixup: x <- lam x + (1 - lam) x[partner], lam ~ U(0, 1) once per step.

``--param loss=mse``: LightlyTrain's ``DistillationV2`` (``distillationv2/distillationv2.py`` and
``distillationv2_loss.py``): ``loss = mean((l(map(S(x))) resized - map(T(x)))^2)``, no normalisation, no queue
(theirs concatenates the last 2 teacher blocks' tokens; here the last block's).

Defaults: theirs (queue of teacher embeddings, temperatures 0.07, local weight 1, AdamW with weight decay 1e-6
for convolutional students, their one-view augmentation: the ``distill`` preset), the queue sized by their rule
from the number of training images (``queue_size=0``: 512 for 1-2k images, 8192 past 20k; `auto_queue_size`).
Not done: their fixed gradient clipping at norm 1 (give ``--grad-clip 1``) and their learning rate's sqrt scaling
with the batch (unison scales linearly).

``--param loss=dino``: DINO-style distillation through the teacher's DINO head, as DINOv2 distils its smaller
models (Oquab et al. 2023, sec. 5: a frozen teacher *with its trained heads*, the student with its own heads, the
DINO cross-entropy; theirs also adds iBOT's masked-patch term and multi-crop, not done here). The teacher is a
unison run of a method with a DINO head (dino, ibot: `unison.methods.distillation.DINOHead`, the run's own
(backbone, head) pair as its kNN evaluated it) or ``random``; anything else is refused before any worker starts
(`unison.training.teacher.teacher_head_spec`). On the same (mixed) view x as above:

    teacher (frozen, eval, no grad):  t = h_T(pool(T(x)))  [B, K]      (h_T: the teacher's DINO head, K its out_dim)
    student:                          s = h_S(pool(S(x)))  [B, K]      (h_S: a new DINO head of h_T's shape)
    loss = mean over images of H(softmax((t - c) / tau_t), softmax(s / tau_s))     (tau_t 0.07, tau_s 0.1)
    c <- m c + (1 - m) mean of t over the global batch  (after the loss, m = 0.9)

with `unison.losses.dino.DINOLoss` (``same_crop``: the pairs (x, x), not DINO's cross-view pairs: teacher and
student see the same view, as LightlyTrain's distillation) and DINO's values of tau_s, m and tau_t after its warm-up
(no warm-up: the teacher is trained). No queue, no local term. The head's shape (out_dim, hidden_dim,
bottleneck_dim, head_layers, head_batch_norm) is the teacher's, recorded in the run's config.

Distributed semantics (exact, ``unison check --method distill``):

* the loss is a mean of per-image terms over this rank's images; the terms read the queue, which every rank
  fills with the same gathered teacher embeddings (`gather_no_grad` in the global sample order, `micro_major`):
  the queue is identical on every rank and equal to one process's;
* mixup pairs each image with a partner from the *global* batch: the images are gathered (no gradient), each
  draws u from `unison.rng` with its (seed, epoch, index) (``needs_sample_keys``), the batch is ordered by
  (u, index) and each image is mixed with the next one in that cycle (theirs: a random permutation, which may
  pair an image with itself); lam is the first image's second draw.
  Pairs and lam are the same at every world size (they depend on the step's samples only). With gather off
  the partners come from the local batch (``exactness_note`` says so);
* the teacher is frozen (``requires_grad=False``, not in the optimizer, no gradient to synchronise), always in
  eval mode (batch norm uses its running statistics), rank-local state (DDP never broadcasts it; every rank
  builds it from the same file, or the same seed), and checkpointed with the run, so `unison eval`/`export`
  of a distilled run need no teacher file. Under ``--shard full`` it is sharded block by block like the
  student and, frozen, resharded after its one forward per step (gathered once per step).
* loss=dino: the per-image terms need nothing from other ranks; the centre c is updated from the all-reduced
  [sum of t, count] of the global batch (`DINOLoss.update_center`), identically on every rank (a rank-local,
  checkpointed buffer); the teacher's head is frozen, in eval mode (its batch norm: running statistics), part of
  the teacher's rank-local state, checkpointed with it and, under ``--shard full``, a sharded unit of its own.
* ``teacher_dtype``: the teacher's parameters may be bf16 (built so by the training layer); its input is
  cast to their dtype and its output back.

Example::

    student, dim = build_backbone("resnet18", 224)
    teacher, tdim = build_backbone("vit_small", 224)        # weights loaded by the caller (same views: same size)
    model = Distill(student, dim, DistillParams(), teacher=teacher, teacher_dim=tdim)
    loss = model([view], keys=SampleKeys(seed, epoch, indices)); loss.backward(); opt.step()
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed import collectives as C
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import DINOLoss
from unison.models.dense import dense_features, make_dense
from unison.rng import sample_uniform

from .base import Recipe, SampleKeys, SSLMethod
from .distillation import DINOHead
from .params import check_params

DINO_LOSS = "dino"
LOSSES = ("kl", "mse", DINO_LOSS)
# the head's fields (of DistillParams, DINOParams, IBOTParams) -> DINOHead's arguments
HEAD_FIELDS = {"out_dim": "out_dim", "hidden_dim": "hidden_dim", "bottleneck_dim": "bottleneck_dim",
               "head_layers": "num_layers", "head_batch_norm": "batch_norm"}
_MIXUP_STREAM = 0x0D15_7111   # the rng stream of mixup's draws (augmentations use small streams)


@dataclass
class DistillParams:
    loss: str = "kl"                    # kl: LightlyTrain's distillation (v3, default); mse: their v2
    queue_size: int = 0                 # teacher embeddings kept; 0: LightlyTrain's rule from the data set size
    temperature_global: float = 0.07
    temperature_local: float = 0.07
    local_weight: float = 1.0
    mixup: bool = True
    # loss=dino (through the teacher's DINO head): DINO's temperatures and centre momentum (tau_t after warm-up)
    student_temp: float = 0.1
    teacher_temp: float = 0.07
    center_momentum: float = 0.9
    # loss=dino: the teacher head's architecture, which the student's head copies; set by the run from the teacher
    # (recorded in its config, so eval/export rebuild it without the teacher): leave them out
    out_dim: int = 0
    hidden_dim: int = 0
    bottleneck_dim: int = 0
    head_layers: int = 0
    head_batch_norm: bool = False

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"Distill parameter loss={self.loss!r} is unknown; use kl (LightlyTrain's distillation), "
                              "mse (their v2) or dino (through a DINO teacher's head) (--param loss=VALUE)")
        check_params(self, counts=("queue_size", "out_dim", "hidden_dim", "bottleneck_dim", "head_layers"),
                     temperatures=("temperature_global", "temperature_local", "student_temp", "teacher_temp"),
                     non_negative=("local_weight",), unit_interval=("center_momentum",))


def head_spec(params: Any) -> dict[str, Any]:
    """`DINOHead`'s arguments (but its input width) from a method's parameters that name a DINO head."""
    return {arg: getattr(params, field) for field, arg in HEAD_FIELDS.items()}


def head_params(spec: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `head_spec`: the method parameters (``out_dim``, ``head_layers``, ...) of `DINOHead` arguments."""
    return {field: spec[arg] for field, arg in HEAD_FIELDS.items()}


# LightlyTrain's queue_size="auto" (distillationv3.py): (data set size below, queue length): about 25-50 % of it
QUEUE_BUCKETS = ((50, 16), (100, 32), (250, 64), (500, 128), (1_000, 256), (2_000, 512), (4_000, 1024),
                 (10_000, 2048), (20_000, 4096))
QUEUE_MAX = 8192


def auto_queue_size(data_size: int | None) -> int:
    """The queue length LightlyTrain picks for `data_size` training images (None, unknown: the largest)."""
    if data_size is None:
        return QUEUE_MAX
    return next((q for below, q in QUEUE_BUCKETS if data_size < below), QUEUE_MAX)


class TeacherHolder(nn.Module):
    """Holds the frozen teacher as ``.backbone`` and, for loss=dino, its DINO head as ``.head`` (never called
    itself: FSDP shards the backbone's blocks and the head, exact accumulation intercepts ``*.backbone`` like the
    momentum teachers')."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head


class Distill(SSLMethod):
    name = "distill"
    Params = DistillParams
    needs_teacher = True
    needs_sample_keys = True   # mixup's partners and lam: from (seed, epoch, index), never the rank
    # LightlyTrain: AdamW lr 5e-4 at batch 1536 (sqrt-scaled), weight decay 1e-6 for conv students; one view.
    recipe = Recipe(optimizer="adamw", base_lr=2e-4, weight_decay=1e-6, augmentation="distill",
                    embedded={"base_lr": 2e-3})

    queue: torch.Tensor
    head: DINOHead          # loss=dino: the student's DINO head
    loss_fn: DINOLoss       # loss=dino: its centre

    def __init__(self, backbone: nn.Module, feature_dim: int, params: DistillParams, *, teacher: nn.Module,
                 teacher_dim: int, data_size: int | None = None, teacher_head: nn.Module | None = None, **kw: Any):
        if not params.queue_size:   # the length used: the training layer records it in the run's config
            params = replace(params, queue_size=auto_queue_size(data_size))
        dino = params.loss == DINO_LOSS
        if dino != (teacher_head is not None):
            raise ValueError(f"Distill: loss={params.loss} takes {'a' if dino else 'no'} teacher_head")
        if isinstance(teacher_head, DINOHead):   # the student's head copies the teacher's (recorded by the run)
            params = replace(params, **head_params(teacher_head.spec))
        super().__init__(make_dense(backbone), feature_dim, params, **kw)
        # mse (v2) matches the maps only, dino the heads' outputs only: no unused head (DDP refuses parameters
        # without a gradient)
        self.head_global = nn.Linear(feature_dim, teacher_dim) if params.loss == "kl" else None
        self.head_local = nn.Linear(feature_dim, teacher_dim) if not dino else None
        for head in (self.head_global, self.head_local):
            if head is not None:
                nn.init.trunc_normal_(head.weight, std=0.02)
        if dino:
            self.head = DINOHead(feature_dim, **head_spec(params))
            self.loss_fn = DINOLoss(params.out_dim, params.student_temp, params.center_momentum,
                                    gather_distributed=self.gather_distributed, same_crop=True)
        for p in [*teacher.parameters(), *(teacher_head.parameters() if teacher_head is not None else ())]:
            p.requires_grad_(False)
        self.teacher = TeacherHolder(make_dense(teacher).eval(), teacher_head)
        self.teacher.eval()
        self.teacher_dim = teacher_dim
        mark_rank_local_state(self.teacher)
        self.register_buffer("queue", torch.zeros(0 if dino else params.queue_size, teacher_dim))   # dino: none
        mark_rank_local_state(self, ["queue"])

    def train(self, mode: bool = True) -> Distill:
        super().train(mode)
        self.teacher.eval()   # batch norm of the teacher: running statistics, never updated
        return self

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return dense_features(self.backbone, x, self.feature_dim)[0]

    @torch.no_grad()
    def _teacher(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = next(self.teacher.parameters()).dtype
        pooled, grid = dense_features(self.teacher.backbone, x.to(dtype), self.teacher_dim)
        return pooled.to(x.dtype), grid.to(x.dtype)

    def _mixup(self, x: torch.Tensor, keys: SampleKeys) -> torch.Tensor:
        """lam x + (1 - lam) x[partner], partners and lam from the step's samples only (module docstring)."""
        u = sample_uniform(keys.seed, keys.epoch, keys.indices.to(x.device), _MIXUP_STREAM, 2)
        index = keys.indices.to(x.device)
        if self.gather_distributed:
            x_all, u_all, i_all = C.gather_no_grad(x), C.gather_no_grad(u), C.gather_no_grad(index)
            start = C.rank() * x.shape[0]
        else:
            x_all, u_all, i_all, start = x.detach(), u, index, 0
        by_index = torch.argsort(i_all)
        order = by_index[torch.argsort(u_all[by_index, 0], stable=True)]   # by (u, index): ties too
        partner = torch.empty_like(order)
        partner[order] = order.roll(-1)
        lam = u_all[order[:1], 1].to(x.dtype)   # [1]: a tensor index of one element would sync with the host
        return lam * x + (1 - lam) * x_all[partner[start:start + x.shape[0]]]

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        x = views[0]   # one view, as LightlyTrain's (further views of another preset are not used)
        if self.params.mixup:
            if keys is None:
                raise ValueError("Distill with mixup needs keys=SampleKeys(seed, epoch, indices)")
            x = self._mixup(x, keys)
        if self.params.loss == DINO_LOSS:
            return self._dino_loss(x)
        t_pooled, t_grid = self._teacher(x)
        s_pooled, s_grid = dense_features(self.backbone, x, self.feature_dim)
        h, w = t_grid.shape[1:3]
        s_local = F.interpolate(cast(nn.Module, self.head_local)(s_grid).permute(0, 3, 1, 2), size=(h, w), mode="bilinear",
                                align_corners=False).permute(0, 2, 3, 1).flatten(1, 2)
        t_local = t_grid.flatten(1, 2)
        if self.head_global is None:   # loss=mse
            return F.mse_loss(s_local, t_local)
        t_pooled = F.normalize(t_pooled, dim=-1)
        self._enqueue(t_pooled)
        queue = self.queue.to(t_pooled.dtype)
        s_pooled = F.normalize(self.head_global(s_pooled), dim=-1)
        p = self.params
        global_loss = _kl(s_pooled @ queue.T / p.temperature_global, t_pooled @ queue.T / p.temperature_global)
        s_local, t_local = F.normalize(s_local, dim=-1), F.normalize(t_local, dim=-1)
        local_loss = _kl(s_local @ s_local.transpose(1, 2) / p.temperature_local,
                         t_local @ t_local.transpose(1, 2) / p.temperature_local)
        return global_loss + p.local_weight * local_loss

    def _dino_loss(self, x: torch.Tensor) -> torch.Tensor:
        """H(softmax((h_T(f_T(x)) - c) / tau_t), softmax(h_S(f_S(x)) / tau_s)) on the same view (module docstring)."""
        head = cast(nn.Module, self.teacher.head)
        with torch.no_grad():   # the head's dtype: the teacher's (bf16 with --teacher-dtype bf16)
            t = head(self._teacher(x)[0].to(next(head.parameters()).dtype)).to(x.dtype)
        s = self.head(self.embed(x))
        return self.loss_fn([s], [t], self.params.teacher_temp)

    @torch.no_grad()
    def _enqueue(self, t: torch.Tensor) -> None:
        """The global batch's teacher embeddings at the front of the queue (every rank the same)."""
        t = C.micro_major(C.gather_no_grad(t)) if self.gather_distributed else t
        t = t.to(self.queue.dtype)
        n, q = t.shape[0], self.queue.shape[0]
        if n >= q:
            self.queue.copy_(t[:q])
        else:
            self.queue.copy_(torch.cat([t, self.queue[:q - n]]))

    def resolved_params(self) -> dict[str, Any]:
        """The parameters this run resolved (the queue's length, loss=dino: the teacher head's architecture),
        recorded in its config so that eval/export rebuild the model without the teacher or the data."""
        fields = ["queue_size", *(HEAD_FIELDS if self.params.loss == DINO_LOSS else ())]
        return {f: getattr(self.params, f) for f in fields}

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            what = "centre" if self.params.loss == DINO_LOSS else "queue"
            return f"gather is off: each rank's {what} and mixup partners come from its local batch"
        return None


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over the leading dimensions of KL(softmax(teacher) || softmax(student)) over the last one."""
    log_p = F.log_softmax(teacher_logits, dim=-1)
    return (log_p.exp() * (log_p - F.log_softmax(student_logits, dim=-1))).sum(-1).mean()
