"""What made a run's numbers non-finite (NaN or inf): one rule for the loss of a step (`unison.training.step`) and
for the embeddings the signals measure (`unison.training.signals`), which reach them first at step 0.

`non_finite_cause` looks, in order, at the weights, the input views, and the backbone's features on those views,
and says the first that is not finite, with what to fix. Before any update (step 0) nothing the optimiser did can
be the cause, so ``--lr`` is never blamed there: the starting weights (``--init``), the backbone itself (a user's
``backbone=``) or the data are. After updates, the training diverged: a lower ``--lr`` or ``--grad-clip``.

The look costs one forward of the backbone in eval mode on this rank only (batch norm uses its running statistics,
so a SyncBatchNorm starts no collective); a ``--shard full`` run's parameters are sharded (a forward would need
every rank), so there it looks at this rank's shards only.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.training.pieces import OWN


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)   # a DTensor (--shard full): this rank's shard
    return to_local() if callable(to_local) else t


def _first_non_finite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    for name, p in named:
        t = _local(p)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _largest(module: nn.Module) -> tuple[float, str]:
    """The largest |w| of `module`'s floating-point parameters, and its name."""
    best, where = 0.0, ""
    for name, p in module.named_parameters():
        t = _local(p)
        if t.is_floating_point() and t.numel():
            m = float(t.detach().abs().max())
            if m > best:
                best, where = m, name
    return best, where


def _starting_weights(cfg: TrainConfig) -> str:
    if cfg.init:
        return f"the weights of --init {cfg.init}"
    if cfg.resume:
        return f"the weights of the checkpoint resumed ({cfg.resume})"
    return "the initial weights"


HUGE = 1e4   # |w| past this is no trained network's weight (theirs are a few units at most)
DIVERGED = "lower --lr, set --grad-clip, or check the data"


@torch.no_grad()
def non_finite_cause(method: nn.Module, views: list[torch.Tensor], cfg: TrainConfig, step: int) -> str:
    """Why the loss or the embeddings of step `step` are not finite, and what to fix. After updates (`step` > 0):
    the training diverged. Before any: the first of the weights, the views and the backbone's features on them
    that is not finite, with where it comes from."""
    if step > 0:
        return DIVERGED
    bad = _first_non_finite(list(method.named_parameters()))   # buffers (batch-norm statistics) follow the forward
    if bad is not None:
        return f"the model's weights hold NaN or inf before any update ({bad}): {_starting_weights(cfg)}; fix them"
    own = str(cfg.backbone or "").startswith(OWN)
    if any(not bool(torch.isfinite(v).all()) for v in views if v.is_floating_point()):
        where = "your dataset= or transform=" if str(cfg.data or "").startswith(OWN) else "the data"
        return f"the input views hold NaN or inf before any update: {where} make(s) them; fix those"
    unknown = f"nothing was updated yet, so not --lr: check {_starting_weights(cfg)} and the data"
    embed = getattr(method, "embed", None)
    if not callable(embed) or not views or cfg.distributed.shard == "full":   # sharded: a forward needs every rank
        return unknown
    was_training = method.training
    method.eval()
    try:
        features = embed(views[0])
    except Exception:   # the look must not hide the NaN behind an error of its own
        return unknown
    finally:
        method.train(was_training)
    if isinstance(features, torch.Tensor) and not bool(torch.isfinite(features.float()).all()):
        largest, where = _largest(getattr(method, "backbone", method))
        if largest > HUGE:
            return (f"the backbone's features overflow to NaN or inf before any update: {_starting_weights(cfg)} "
                    f"reach |w| = {largest:.3g} (in {where}); start from weights that give finite features (a "
                    "trained network's are a few units at most)")
        who = f"your backbone= ({str(cfg.backbone)[len(OWN):]})" if own else f"the backbone {cfg.backbone}"
        return (f"{who} returns NaN or inf before any update, for finite input views and finite weights (|w| <= "
                f"{largest:.3g}): its forward makes them; fix it")
    return ("the weights and the backbone's features are finite before any update, so the method's loss itself is "
            "not (not --lr: nothing was updated yet): check its --param values and the data")
