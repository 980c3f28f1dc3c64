"""PowerSGD state that survives a checkpoint: error feedback, warm-start memories, step counter, RNG.

torch's `powerSGD_hook` keeps its state per DDP *bucket*: ``error_dict[bucket]`` (this rank's
residual of the bucket's flat gradient buffer), ``p_memory_dict``/``q_memory_dict[bucket]``
(the warm-start low-rank factors), plus ``iter`` and a numpy RNG. Bucket layouts are not
stable: DDP builds its buckets in parameter order and rebuilds them after the first iteration
in gradient-ready order, *in every new process*. A resumed process therefore runs its first
(compressed) iteration with a different layout than the one the state was saved under; loading
the bucket tensors as they are would add the wrong residual to the wrong gradient, silently
when the sizes agree. (torch itself asks for ``start_powerSGD_iter > 1`` for this reason.)

`CheckpointablePowerSGD` wraps the hook and stores the state **per parameter**: each bucket's
flat tensors are split by the parameters it holds (error: the parameter's slice; P, Q: the
parameter's factor, found with the same grouping torch uses), and reassembled for whatever
bucket layout the current process has. The per-tensor maths of PowerSGD does not depend on how
tensors are bucketed, so a resumed run computes exactly what the uninterrupted one does.

Error feedback is this rank's own residual: the component is registered ``per_rank`` (see
`unison.training.checkpoint.extra_state`); resuming at another world size starts it fresh.

Example::

    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10)
    ckpt_state = CheckpointablePowerSGD(state, ddp.module)
    ddp.register_comm_hook(state, ckpt_state.hook)
    run.extra_state.register("powersgd", ckpt_state, per_rank=True)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


def _matrix_shape(grad: torch.Tensor) -> tuple[int, int]:
    n = grad.shape[0] if grad.dim() > 0 else 1
    return n, grad.numel() // max(n, 1)


class CheckpointablePowerSGD:
    """A `PowerSGDState` whose `state_dict` is keyed by parameter name, not by DDP bucket."""

    def __init__(self, state: psgd.PowerSGDState, model: nn.Module) -> None:
        self.state = state
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._layouts: dict[int, tuple[str, ...]] = {}       # bucket index -> parameter names, current layout
        self._shapes: dict[str, tuple[int, int, int]] = {}   # name -> (numel, n, m) of the gradient matrix
        self._seen: set[int] = set()                          # buckets already hooked in this iteration
        self._pending: dict[str, dict[str, torch.Tensor]] = {}   # per-parameter state waiting for its bucket
        self._warm: set[str] = set()                          # parameters whose bucket had warm-start memory

    # ------------------------------------------------------------------ the hook
    def hook(self, state, bucket):  # no annotations: DDP compares them with the classes, and these would be strings
        """The comm hook: `powerSGD_hook`, with this process's bucket layout aligned to the saved state first."""
        self._align(bucket)
        return psgd.powerSGD_hook(state, bucket)

    def _align(self, bucket: dist.GradBucket) -> None:
        index = bucket.index()
        if index == 0:
            self._seen = set()
        layout = tuple(self._names[id(p)] for p in bucket.parameters())
        for name, g in zip(layout, bucket.gradients()):
            self._shapes[name] = (g.numel(), *_matrix_shape(g))
        known = self._layouts.get(index)
        if known != layout:
            if known is not None:
                # DDP rebuilt its buckets (it does so before the first hook of an iteration): every bucket not yet
                # hooked in this iteration still holds state in the old layout; take it apart by parameter.
                for old in [i for i in self._layouts if i not in self._seen]:
                    self._split_bucket(old)
                    del self._layouts[old]
            self._layouts[index] = layout
            self._assemble_bucket(index, layout, bucket.buffer())
        self._seen.add(index)

    # ------------------------------------------------------------------ layout of one bucket
    def _factor_slices(self, layout: tuple[str, ...]) -> dict[str, tuple[slice, slice]]:
        """P and Q slices of every compressed parameter in its bucket's memories (torch's grouping by shape)."""
        r_max, rate = self.state.matrix_approximation_rank, self.state.min_compression_rate
        groups: OrderedDict[tuple[int, int], list[str]] = OrderedDict()
        for name in layout:
            _, n, m = self._shapes[name]
            r = min(n, m, r_max)
            if (n + m) * r * rate < n * m:   # psgd._should_compress
                groups.setdefault((n, m), []).append(name)
        out, p_at, q_at = {}, 0, 0
        for (n, m), names in groups.items():
            r = min(n, m, r_max)
            for name in names:
                out[name] = (slice(p_at, p_at + n * r), slice(q_at, q_at + m * r))
                p_at, q_at = p_at + n * r, q_at + m * r
        return out

    def _split_bucket(self, index: int) -> None:
        layout, st = self._layouts[index], self.state
        error, p_mem, q_mem = st.error_dict.pop(index, None), st.p_memory_dict.pop(index, None), \
            st.q_memory_dict.pop(index, None)
        if error is None and p_mem is None:
            return
        at = 0
        slices = self._factor_slices(layout) if p_mem is not None else {}
        for name in layout:
            numel = self._shapes[name][0]
            piece = self._pending.setdefault(name, {})
            if error is not None:
                piece["error"] = error[at:at + numel].clone()
            if p_mem is not None and q_mem is not None:
                self._warm.add(name)
                if name in slices:
                    ps, qs = slices[name]
                    piece["p"], piece["q"] = p_mem[ps].clone(), q_mem[qs].clone()
            at += numel

    def _assemble_bucket(self, index: int, layout: tuple[str, ...], buffer: torch.Tensor) -> None:
        pieces = [self._pending.pop(name, {}) for name in layout]
        warm = [name for name in layout if name in self._warm]
        self._warm.difference_update(layout)
        st = self.state
        if pieces and all("error" in piece for piece in pieces):
            st.error_dict[index] = torch.cat([piece["error"] for piece in pieces])
        if warm:
            by_name = dict(zip(layout, pieces))
            slices = self._factor_slices(layout)
            if all("q" in by_name[name] for name in slices):
                st.p_memory_dict[index] = torch.cat([by_name[n]["p"] for n in slices]) if slices else buffer.new_empty(0)
                st.q_memory_dict[index] = torch.cat([by_name[n]["q"] for n in slices]) if slices else buffer.new_empty(0)

    # ------------------------------------------------------------------ Stateful
    def _per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole state by parameter name, without disturbing the live per-bucket state."""
        saved = (dict(self.state.error_dict), dict(self.state.p_memory_dict), dict(self.state.q_memory_dict),
                 dict(self._pending), set(self._warm))
        self._pending = {k: dict(v) for k, v in self._pending.items()}
        try:
            for index in list(self._layouts):
                self._split_bucket(index)
            return {name: {**piece, "warm": torch.tensor(name in self._warm)} for name, piece in self._pending.items()}
        finally:
            (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict, self._pending,
             self._warm) = saved

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = self.state.rng.get_state(legacy=True)   # type: ignore[misc]
        return {"iter": int(self.state.iter), "next_stats_report": int(self.state.next_stats_report),
                "total_numel_before_compression": int(self.state.total_numel_before_compression),
                "total_numel_after_compression": int(self.state.total_numel_after_compression),
                "rng": {"bit_generator": str(name), "keys": torch.as_tensor(keys, dtype=torch.int64), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "parameters": self._per_parameter()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        st = self.state
        st.iter = int(state["iter"])
        st.next_stats_report = int(state["next_stats_report"])
        st.total_numel_before_compression = int(state["total_numel_before_compression"])
        st.total_numel_after_compression = int(state["total_numel_after_compression"])
        rng = state["rng"]
        st.rng.set_state((rng["bit_generator"], rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"],
                          rng["cached_gaussian"]))
        st.error_dict.clear()
        st.p_memory_dict.clear()
        st.q_memory_dict.clear()
        self._layouts.clear()
        self._pending = {name: {k: v for k, v in piece.items() if k != "warm"}
                         for name, piece in state["parameters"].items()}
        self._warm = {name for name, piece in state["parameters"].items() if bool(piece.get("warm", False))}
