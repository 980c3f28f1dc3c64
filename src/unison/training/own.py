"""The checks of the user's own pieces (``unison.train(cfg, backbone=..., feature_dim=..., dataset=..., transform=...)``).

`OwnPieces` (`unison.training.pieces`) holds them; `check_pieces` is their whole check before any worker starts
(`unison.train`'s pre-flight and `unison.check`'s call it): the first item of the dataset and its views
(`unison.data.own`), one forward of the backbone on a dummy batch of each view size (its output must be
``[batch, feature_dim]``) and the method built around a copy of it (the types and the options they replace:
`OwnPieces.check_types` and `OwnPieces.apply`, in `validate_run`). `check_picklable` runs where the pieces travel
to unison's worker processes (world size > 1): pickled, as the launcher sends them, they must load in a fresh
process, so a lambda or a class defined inside a function is one line naming the piece, not a traceback in every
worker.

In the workers, `unison.training.step.build_run` builds the method around a copy of the backbone (the object
passed is never modified: the trained weights are in the run's checkpoints), converts its batch norm to SyncBN as
for unison's backbones, and reads the dataset through `unison.data.own.build_own_source`.

Example::

    pieces = OwnPieces(backbone=MyNet(), feature_dim=512, dataset=MyPhotos("/data"), transform=my_views)
    check_pieces(resolve_run(cfg, own=pieces), pieces)
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import sys
from typing import Any, cast

import torch
import torch.nn as nn

from unison.data.augment import PRESETS, view_sizes
from unison.errors import ConfigError
from unison.training.init_read import init_weights_of
from unison.training.model import build_method
from unison.training.pieces import OwnPieces
from unison.training.resolve import RunPlan, data_spec
from unison.training.step import build_data

__all__ = ["OwnPieces", "check_features", "check_picklable", "check_pieces"]

def check_pieces(plan: RunPlan, pieces: OwnPieces, sizes: list[int] | None = None) -> None:
    """The pieces against the run `plan` (`resolve_run`'s, `OwnPieces.apply` done): the dataset's first item and its
    views, then the backbone on a dummy batch of every view size (those of the views, else `sizes`, else the
    configuration's). Raises `ConfigError`/`DataError` with one line."""
    from unison.data.own import OwnBatches, seeded_rngs

    cfg, augmentation = plan.cfg, plan.recipe.augmentation
    if pieces.dataset is not None:
        data = build_data(plan, torch.device("cpu"), None, None, pieces)
        first = cast(OwnBatches, data.source).make.of(0, [0], [data.own.first()])["views"]
        sizes = [int(v.shape[-1]) for v in first]
    if pieces.backbone is not None:
        size = cfg.image_size or 32
        sizes = sizes or view_sizes({**PRESETS[augmentation], **data_spec(cfg, plan.recipe.at_size(cfg, size)).augment_overrides()}, size)
        check_features(pieces.backbone, pieces.feature_dim or 0, sorted(set(sizes)))
        # the method around (a copy of) it, as every worker builds it: a method that needs a ViT's patch tokens
        # (MAE, iBOT, I-JEPA) refuses here, and --init/--freeze/--layer-decay are checked against it; the build
        # seeds the global RNGs, the caller's are restored after
        with seeded_rngs(cfg.seed, 0, 0, 0):
            build_method(cfg, 1, torch.float32, torch.device("cpu"), max(sizes), view_sizes=sizes,
                         own=(pieces.backbone, pieces.feature_dim or 0), setup={}, init=init_weights_of(cfg))


def check_features(backbone: nn.Module, feature_dim: int, sizes: list[int]) -> None:
    """One forward of `backbone` on 2 images of each size, in eval mode and (on a copy: its batch-norm statistics
    move) in training mode, without gradients: the output must be finite ``[2, feature_dim]`` in both (training
    embeds in both modes: the step in training mode, kNN and the signals in eval mode). The object passed is left
    as it was."""
    from unison.data.own import user_raised

    param = next(iter(backbone.parameters()), None)
    device, dtype = (param.device, param.dtype) if param is not None else (torch.device("cpu"), torch.float32)
    name = type(backbone).__name__
    was_training = backbone.training
    try:
        for mode, net in (("eval", backbone.eval()), ("training", copy.deepcopy(backbone).train())):
            for size in sizes:
                images = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
                with torch.no_grad():
                    try:
                        out = net(images)
                    except Exception as e:   # the user's code: any error, said in one line with its frame
                        raise ConfigError(str(user_raised(f"backbone= {name} fails on a batch of 2 images of "
                                                          f"{size}x{size} px in {mode} mode (the views' size)", e))) from None
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                if shape != (2, feature_dim):
                    raise ConfigError(f"backbone= {name} in {mode} mode returns {shape} for 2 images of {size}x{size} "
                                      f"px; it must return [batch, feature_dim] = (2, {feature_dim}), in training and "
                                      "eval mode alike: give the right feature_dim, or end the backbone with "
                                      "flatten/pooling")
                if not bool(out.isfinite().all()):
                    raise ConfigError(f"backbone= {name} returns non-finite features (NaN or inf) for 2 images of "
                                      f"{size}x{size} px in {mode} mode (pixels in [0, 1]); check its weights and "
                                      "forward")
    finally:
        backbone.train(was_training)


class _Sink(io.RawIOBase):
    """A file that keeps nothing: pickling into it checks without holding a copy of the pieces."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return memoryview(b).nbytes   # bytes, or a PickleBuffer (protocol 5: a NumPy array's data), which has no len()


def check_picklable(pieces: OwnPieces) -> None:
    """Each piece must pickle (the launcher sends it to every worker); `ConfigError` naming the one that does not."""
    for what, piece in (("backbone", pieces.backbone), ("dataset", pieces.dataset), ("transform", pieces.transform),
                        ("val", pieces.val)):
        if piece is None:
            continue
        module = getattr(piece, "__module__", None) if callable(piece) and not isinstance(piece, nn.Module) \
            else type(piece).__module__
        if module == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
            raise ConfigError(f"{what}= is defined in an interactive session, which the worker processes cannot "
                              "import; define it in a module (a .py file) or train with world_size=1")
        try:
            pickle.Pickler(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(piece)
        except Exception as e:
            why = re.sub(r" at 0x[0-9a-f]+", "", str(e).splitlines()[0] if str(e) else "")   # no addresses
            raise ConfigError(f"{what}= cannot be sent to the worker processes ({type(e).__name__}: {why}); define "
                              "it, and everything it holds, at module level (a class or def in a module, no lambda "
                              "or local function), or train with world_size=1") from None
