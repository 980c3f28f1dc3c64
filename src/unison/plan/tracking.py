"""What a simulated step holds, counted: torch's `MemTracker` (adapted to the training step) and the bytes of the
collectives. Used by `unison.plan` and by the real step the plan is validated against
(tests/helpers/plan_measure.py); the model's state is `unison.training.memory`'s estimate."""

from __future__ import annotations

from typing import Any

import torch

from unison.distributed.tagging import rank_local_state_names

__all__ = ["device_snapshot", "tracker_class"]


class _NoHook:
    def remove(self) -> None:
        pass


def tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """MemTracker hooks the gradient of every parameter, which torch refuses for frozen ones (momentum
        teachers; FSDP2 swaps in their unsharded parameters at each forward): those get none."""

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            """A step of several micro-batches calls the top module once per micro-batch, which MemTracker takes
            for a second iteration and refuses: its per-module statistics start afresh (the plan reports the
            device's peak, over the whole step, which this leaves as it is)."""
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            """The device's peak only: MemTracker also updates the peak of every module the step is inside, in a
            loop over all modules at each allocation, which the plan never reads and which would dominate the time
            of a large model's many-rank simulation."""
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)   # byte counts: a shallow copy is a whole copy

    return Tracker


def params_and_buffers_at_peak(peak: dict) -> tuple[int, int]:
    dev = device_snapshot(peak)
    return int(dev.get("Parameter", 0)), int(dev.get("Buffer", 0))


def activations_and_peak(peak: dict) -> tuple[int, int]:
    dev = device_snapshot(peak)
    return int(dev.get("Activation", 0) + dev.get("Temp", 0)), int(dev.get("Total", 0))


def device_snapshot(peak: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for stats in peak.values():   # one device (the simulated one)
        for key, value in stats.items():
            out[str(getattr(key, "value", key))] = out.get(str(getattr(key, "value", key)), 0) + int(value)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t   # FSDP2: this rank's shard of a DTensor


def ddp_grad_bytes(run: Any) -> int:
    ignored = set(rank_local_state_names(run.method))
    return sum(p.numel() * p.element_size() for n, p in run.method.named_parameters()
               if p.requires_grad and n not in ignored)


def fsdp_bytes(run: Any, reshard_after_forward: bool) -> dict[str, int]:
    """Per step: each unit's shard all-gathered in the forward and again in the backward (once if it stays
    gathered), each gradient reduce-scattered (payload: the whole gradient, as `CommMeter` counts it)."""
    shards = sum(_local(p).numel() * p.element_size() for p in run.method.parameters())
    full = sum(p.numel() * p.element_size() for p in run.method.parameters() if p.requires_grad)
    return {"all_gather_into_tensor": shards * (2 if reshard_after_forward else 1), "reduce_scatter_tensor": full}
