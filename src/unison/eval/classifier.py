"""A backbone with a new linear head: the model that fine-tuning and the standard linear protocol train.

`Classifier(backbone, feature_dim, num_classes, ...)` maps images to class logits: the backbone's pooled feature,
optionally a batch norm without parameters (MAE's linear probe: the features standardised, so one learning rate
serves every backbone), and a linear layer. The head is initialised from a generator of its own seeded by `seed`
(normal, std `head_init_std`, bias 0): the same weights on every rank and at every world size, and the global
RNG is left as it was. ``frozen=True`` (the linear protocol): the backbone's parameters do not train, it runs
without a graph, and its batch norms keep their running statistics (`hold_running_statistics`: in eval mode
whatever ``train()`` says), so the features are those of the trained encoder, as the protocol defines it.

Drop path (stochastic depth) must not draw from a per-rank generator: which samples skip a block would then
depend on the rank a sample lands on, and W workers would not train like one. `install_drop_path` replaces the
``drop_path1``/``drop_path2`` of every transformer block (unison's ViTs, timm's) by a `KeyedDropPath`, whose
per-sample keep decision is ``u >= rate`` with ``u`` drawn from (seed, epoch, sample index, column)
(`unison.rng.sample_uniform`): the same decision for a sample whatever the world size, the batch and the rank.
Rates grow linearly over the blocks, 0 at the first and `rate` at the last, as timm's ``drop_path_rate``. Before
each step, `DropPathKeys.set` gives the blocks this rank's sample indices.

Example::

    model = Classifier(backbone, 192, num_classes=10, head_init_std=2e-5, seed=0)
    keys = install_drop_path(model.backbone, 0.1)
    keys.set(seed=0, epoch=3, indices=batch_indices)
    logits = model(images)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from unison.distributed.sync_batchnorm import hold_running_statistics
from unison.errors import ConfigError
from unison.rng import sample_uniform

__all__ = ["Classifier", "DropPathKeys", "KeyedDropPath", "install_drop_path"]

DROP_PATH_STREAM = 0xD809   # the uniforms of drop path; the augmentation uses small streams (one per view)


class Classifier(nn.Module):
    """Backbone -> (parameter-free batch norm) -> linear head; see the module docstring."""

    def __init__(self, backbone: nn.Module, feature_dim: int, num_classes: int, *, head_init_std: float = 0.01,
                 head_norm: bool = False, frozen: bool = False, seed: int = 0):
        super().__init__()
        self.backbone, self.frozen = backbone, frozen
        param = next(backbone.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        device = param.device if param is not None else torch.device("cpu")
        self.norm: nn.Module = (nn.BatchNorm1d(feature_dim, affine=False, device=device, dtype=dtype) if head_norm
                                else nn.Identity())
        self.head = nn.utils.skip_init(nn.Linear, feature_dim, num_classes, device=device, dtype=dtype)
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            weight = torch.randn(num_classes, feature_dim, generator=generator, dtype=torch.float64) * head_init_std
            self.head.weight.copy_(weight.to(dtype))
            self.head.bias.zero_()
        if frozen:
            backbone.requires_grad_(False)
            for module in backbone.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    hold_running_statistics(module)

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        if self.frozen:   # dropout and the like off too: the protocol scores the encoder as trained
            self.backbone.eval()
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:
            with torch.no_grad():
                return self.backbone(x)
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)
        if f.dtype != self.head.weight.dtype:   # bf16 autocast: the head in its own precision
            f = f.to(self.head.weight.dtype)
        return self.head(self.norm(f))


class DropPathKeys:
    """The uniforms of this step's drop-path decisions, one column per residual branch, for this rank's samples."""

    def __init__(self, columns: int):
        self.columns = columns
        self.uniforms: torch.Tensor | None = None

    def set(self, seed: int, epoch: int, indices: torch.Tensor) -> None:
        self.uniforms = sample_uniform(seed, epoch, indices, DROP_PATH_STREAM, self.columns)

    def clear(self) -> None:
        self.uniforms = None


class KeyedDropPath(nn.Module):
    """Skips the residual branch of a sample with probability `rate` (scaling the kept ones by 1 / (1 - rate)),
    decided by column `column` of `keys`' uniforms; the identity in eval mode or before `DropPathKeys.set`."""

    def __init__(self, rate: float, column: int, keys: DropPathKeys):
        super().__init__()
        self.rate, self.column, self.keys = float(rate), column, keys

    def extra_repr(self) -> str:
        return f"rate={self.rate:.4g}, column={self.column}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.keys.uniforms
        if not self.training or self.rate == 0 or u is None:
            return x
        keep = (u[:, self.column] >= self.rate).to(device=x.device, dtype=x.dtype) / (1 - self.rate)
        return x * keep.view(-1, *([1] * (x.dim() - 1)))


def install_drop_path(backbone: nn.Module, rate: float) -> DropPathKeys | None:
    """Drop path of rate `rate` (the last block's) on every transformer block of `backbone`; None for rate 0.
    A backbone without such blocks (a CNN) is one line: drop path is defined for residual transformer blocks."""
    if rate == 0:
        return None
    blocks = [b for b in getattr(backbone, "blocks", []) if hasattr(b, "drop_path1") and hasattr(b, "drop_path2")]
    if not blocks:
        raise ConfigError(f"--drop-path {rate:g} needs a transformer backbone (blocks with residual branches); "
                          f"{type(backbone).__name__} has none: leave --drop-path out (0)")
    keys = DropPathKeys(2 * len(blocks))
    for i, block in enumerate(blocks):
        block_rate = rate * i / (len(blocks) - 1) if len(blocks) > 1 else 0.0
        block.drop_path1 = KeyedDropPath(block_rate, 2 * i, keys)
        block.drop_path2 = KeyedDropPath(block_rate, 2 * i + 1, keys)
    return keys
