"""The memory one rank's model state needs: parameters, buffers, gradients and optimizer state, counted from the
model's tensors by the rules the run applies. The one estimate of it: the pre-flight's memory check
(`unison.training.preflight.check_model_memory`, on a meta-device build, before any worker starts) and
`unison plan` (beside the peak it measures on its simulated step) both call `model_state`, so the two can never
disagree on what the model holds.

The rules, per rank of a W-rank run:

* parameters and buffers: all of them; under ``--shard full`` (FSDP2) a 1/W shard of every parameter;
* gradients: one per trainable parameter (a momentum teacher's frozen copy has none), in its dtype; FSDP2: a shard;
* optimizer state: `unison.optim.state_per_parameter` (SGD and LARS a momentum buffer unless momentum is 0; Adam
  and AdamW two moments and a step counter) for each trainable parameter; ``--shard optimizer`` (ZeRO-1) and FSDP2
  keep a 1/W share of it.

Shards are counted as exact fractions: FSDP2 pads a parameter's first dimension to a multiple of W and ZeRO-1 gives
each rank whole parameters, so a rank's real share differs by at most a parameter's padding or its largest
parameter. Usage::

    state = model_state(method, cfg, "adamw")     # the method built on any device, meta included
    state.total                                  # bytes this rank holds in a step, before activations
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unison.config import TrainConfig
from unison.optim import state_per_parameter

__all__ = ["ModelState", "model_state"]


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's model state; `built`: every parameter and buffer whole, as each worker builds the model
    before FSDP2 shards it; `largest`: the name of the model's largest tensor (for messages)."""

    params: int
    buffers: int
    grads: int
    optimizer: int
    built: int
    largest: str

    @property
    def total(self) -> int:
        return self.params + self.buffers + self.grads + self.optimizer


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()   # a DTensor's numel is the whole parameter's


def model_state(method: nn.Module, cfg: TrainConfig, optimizer: str) -> ModelState:
    """`method`'s state on one rank of the run `cfg` describes, trained by the resolved `optimizer` (the recipe's
    unless the configuration names one)."""
    world = cfg.distributed.world_size
    shard = cfg.distributed.shard
    params = dict(method.named_parameters())
    buffers = dict(method.named_buffers())
    trainable = [p for p in params.values() if p.requires_grad]
    full, scalars = state_per_parameter(optimizer, cfg.momentum)
    scalar_bytes = torch.empty(()).element_size()   # torch's optimizers keep step counters in the default dtype
    whole_params = sum(_bytes(p) for p in params.values())
    param_bytes = whole_params
    buffer_bytes = sum(_bytes(b) for b in buffers.values())
    grad_bytes = sum(_bytes(p) for p in trainable)
    optimizer_bytes = full * grad_bytes + scalars * scalar_bytes * len(trainable)
    if shard == "full":
        param_bytes, grad_bytes = param_bytes // world, grad_bytes // world
    if shard in ("full", "optimizer"):
        optimizer_bytes //= world
    tensors = {**params, **buffers}
    largest = max(tensors, key=lambda name: tensors[name].numel(), default="")
    return ModelState(param_bytes, buffer_bytes, grad_bytes, optimizer_bytes,
                      whole_params + buffer_bytes, largest)
