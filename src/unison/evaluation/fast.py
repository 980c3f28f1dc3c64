"""The fast protocols of ``unison eval`` on one backbone: weighted kNN and the fast linear probe, on the features
of the bounded sets (`unison.evaluation.sets`), every image embedded once; and the randomly initialised backbone
that ``--from-scratch`` scores the same way."""

from __future__ import annotations

import time
from typing import Any

import torch

from unison.config import TrainConfig
from unison.errors import ConfigError, DataError

from .options import EvalOptions
from .sets import EvalData


@torch.no_grad()
def knn_top1(train_f: torch.Tensor, train_y: torch.Tensor, val_f: torch.Tensor, val_y: torch.Tensor,
             num_classes: int, k: int, t: float, chunk: int = 1024) -> float:
    from unison.eval.knn import knn_predict

    bank = torch.nn.functional.normalize(train_f, dim=1)
    query = torch.nn.functional.normalize(val_f, dim=1)
    correct = 0
    for i in range(0, query.shape[0], chunk):  # chunks bound the [Q, N] similarity matrix
        pred = knn_predict(query[i:i + chunk], bank, train_y, num_classes, k, t)
        correct += int((pred == val_y[i:i + chunk]).sum())
    return correct / query.shape[0]


def features(method: Any, images: Any, to_eval: Any, opts: EvalOptions, what: str) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    from unison.eval.knn import embed_all
    from unison.progress import Progress

    return embed_all(method.embed, images, to_eval, opts.batch_size, normalise=False,
                     progress=Progress(f"eval: embedding {what}", images.shape[0]))


def fast_scores(method: Any, ev: EvalData, cfg: TrainConfig, opts: EvalOptions, which: str = "") -> dict[str, Any]:
    """kNN and/or the fast linear probe of `method`'s backbone on `ev`'s sets (what `opts` asks for)."""
    from unison.data.augment import eval_transform
    from unison.eval.knn import report_unreadable
    from unison.eval.linear import linear_probe

    dtype = getattr(torch, cfg.precision)

    def to_eval(x: torch.Tensor) -> torch.Tensor:  # as the training loop's kNN: the run's size and mean/std
        y = eval_transform(x, ev.image_size, ev.mean, ev.std).to(dtype)
        return y.contiguous(memory_format=torch.channels_last) if cfg.nhwc else y

    t1 = time.perf_counter()
    device = next(method.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):   # as training's kNN
        train_f, train_ok = features(method, ev.sets.reference, to_eval, opts, f"the reference set{which}")
        val_f, val_ok = features(method, ev.sets.queries, to_eval, opts, f"the held-out set{which}")
    report_unreadable(int((~train_ok).sum() + (~val_ok).sum()), ev.sets.reference, ev.sets.queries)
    train_f, train_y = train_f[train_ok], ev.sets.reference_labels[train_ok]
    val_f, val_y = val_f[val_ok], ev.sets.query_labels[val_ok]
    if not (len(train_f) and len(val_f)):
        raise DataError("none of the reference or held-out images could be read; fix the data or give other data")
    t2 = time.perf_counter()
    num_classes = ev.sets.num_classes
    out: dict[str, Any] = {"train_images": len(train_f), "val_images": len(val_f), "feature_dim": int(train_f.shape[1]),
                           "knn_top1": None, "linear_top1": None, "linear_train_top1": None, "feature_time_s": t2 - t1}
    if opts.knn:
        out["knn_top1"] = knn_top1(train_f, train_y, val_f, val_y, num_classes, opts.knn_k, opts.knn_t)
        out["knn_time_s"] = time.perf_counter() - t2
    if opts.fast_linear:
        t3 = time.perf_counter()
        probe = linear_probe(train_f, train_y, val_f, val_y, num_classes, epochs=opts.linear_epochs,
                             lr=opts.linear_lr, batch_size=opts.linear_batch_size, optimizer=opts.linear_optimizer,
                             normalise=opts.linear_norm, seed=opts.seed)
        out["linear_top1"], out["linear_train_top1"] = probe.top1, probe.train_top1
        out["linear_time_s"] = time.perf_counter() - t3
    return out


def scratch_method(checkpoint: str, cfg: TrainConfig, ckpt: dict[str, Any], device: torch.device) -> Any:
    """The run's method as its training started: the same architecture, initialised by the run's seed, no weights
    read (distill's teacher: its architecture only); in eval mode. A run of your own backbone is refused (unison
    cannot re-initialise a module it did not build)."""
    from unison.training.load import own_backbone_weights, preprocessing
    from unison.training.model import build_method

    if own_backbone_weights(ckpt) is not None:
        raise ConfigError(f"--from-scratch: {checkpoint} trained your own backbone, which unison cannot initialise "
                          "again; evaluate a fresh instance of it as a run of its own")
    method = build_method(cfg, 1, getattr(torch, cfg.precision), device,
                          image_size=preprocessing(cfg, ckpt)["image_size"], teacher_weights=False)
    return method.eval()
