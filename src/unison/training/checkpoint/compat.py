"""Whether a checkpoint's model state fits a model: every key and shape, named in one line when not.

Checked before ``load_state_dict`` so that a resume or an export with other options (another
projector size, a DDP-wrapped state dict) fails with what differs, not with torch's multi-line error.
"""

from __future__ import annotations

import torch

from unison.errors import CheckpointError


def _fmt_shape(shape: torch.Size) -> str:
    return str(tuple(shape))


def _few(keys: list[str], what: str) -> str:
    shown = ", ".join(str(k) for k in keys[:3]) + (f", ... ({len(keys) - 3} more)" if len(keys) > 3 else "")
    return f"{len(keys)} {what}{'s' if len(keys) != 1 else ''} ({shown})"


def check_compatible(model: torch.nn.Module, model_state: dict) -> None:
    """Raise `CheckpointError` unless `model_state` has exactly the model's keys and shapes.

    Call before ``model.load_state_dict(model_state)``: the message names (up to a few)
    missing keys, unexpected keys and shape mismatches on one line.
    """
    if not isinstance(model_state, dict):
        raise CheckpointError(f"model state must be a dict (a state_dict), got {type(model_state).__name__}")
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    missing = [k for k in expected if k not in model_state]
    unexpected = [k for k in model_state if k not in expected]
    mismatched = [
        f"{'parameter' if k in params else 'buffer'} {k} has shape {_fmt_shape(v.shape)} in the checkpoint "
        f"but {_fmt_shape(expected[k].shape)} in the model"
        for k, v in model_state.items()
        if k in expected and isinstance(v, torch.Tensor) and isinstance(expected[k], torch.Tensor)
        and v.shape != expected[k].shape
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(_few(missing, "missing key"))
    if unexpected:
        parts.append(_few(unexpected, "unexpected key"))
    parts += mismatched[:3]
    if len(mismatched) > 3:
        parts.append(f"{len(mismatched) - 3} more shape mismatches")
    hint = ""
    if unexpected and all(str(k).startswith("module.") for k in model_state):
        hint = "; the checkpoint keys start with 'module.' (a DDP wrapper): save model.module.state_dict()"
    raise CheckpointError("checkpoint does not match the model: " + "; ".join(parts) + hint)
