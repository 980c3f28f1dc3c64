"""Count the bytes each worker hands to collectives, as they happen (not estimated).

`CommMeter` wraps the Python entry points of `torch.distributed` (all_reduce, all_gather,
all_gather_into_tensor, broadcast, reduce_scatter_tensor and DDP's coalesced buffer
broadcast) for the duration of a ``with`` block and adds up ``numel * element_size`` of
every tensor this process contributes. DDP's built-in gradient all-reduce runs in C++
and is invisible to Python, so while metering, DDP is given the equivalent Python
`allreduce_hook` (see `unison.parallel.ddp.wrap_ddp`), which calls `dist.all_reduce`
on each gradient bucket: every gradient byte is then counted.

The figure is the payload per worker per call; a ring all-reduce moves about
2 (W-1)/W times that over the wire.

Example::

    with CommMeter() as meter:
        loss = ddp_model(views); loss.backward()
    print(meter.bytes)          # {'all_reduce': 4123648, 'all_gather': 131072}
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
            "_broadcast_coalesced")


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


_Meter = TypeVar("_Meter", bound="CommMeter")   # `with Subclass() as m` gives the subclass


class CommMeter:
    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals: dict[str, Any] = {}

    def _payload(self, name: str, args: tuple, kwargs: dict) -> int:
        if name == "all_gather":  # (output_list, input)
            return _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor"))
        if name == "all_gather_into_tensor":  # (output, input)
            return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor"))
        if name == "reduce_scatter_tensor":  # (output, input)
            return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
        if name == "_broadcast_coalesced":  # (process_group, tensors, buffer_size, src)
            return _nbytes(args[1] if len(args) > 1 else None)
        return _nbytes(args[0] if args else kwargs.get("tensor"))

    def __enter__(self: _Meter) -> _Meter:
        for name in _WRAPPED:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original

            def counted(*args, __name=name, __orig=original, **kwargs):
                self.bytes[__name] += self._payload(__name, args, kwargs)
                self.calls[__name] += 1
                return __orig(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
