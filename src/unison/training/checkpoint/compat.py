"""Whether a checkpoint's model state fits a model: every key, shape and kind of dtype, named in one line when not.

Checked before ``load_state_dict`` so that a resume or an export with other options (another
projector size, a DDP-wrapped state dict) fails with what differs, not with torch's multi-line error.
"""

from __future__ import annotations

import torch

from unison.errors import CheckpointError


def _fmt_shape(shape: torch.Size) -> str:
    return str(tuple(shape))


def _key(k: object) -> str:
    """A state-dict key for a message: a checkpoint's keys may be anything, of any length."""
    text = str(k)
    return text if len(text) <= 80 else text[:77] + "..."


def _few(keys: list[str], what: str, plural: str | None = None) -> str:
    shown = ", ".join(_key(k) for k in keys[:3]) + (f", ... ({len(keys) - 3} more)" if len(keys) > 3 else "")
    return f"{len(keys)} {what if len(keys) == 1 else plural or what + 's'} ({shown})"


def check_compatible(model: torch.nn.Module, model_state: dict | None, path: object = None) -> None:
    """Raise `CheckpointError` unless `model_state` has exactly the model's keys and shapes.

    Call before ``model.load_state_dict(model_state)``: the message names (up to a few)
    missing keys, unexpected keys and shape mismatches on one line. `path`: the checkpoint, named in the message
    about a value that is not a tensor or not finite.
    """
    if model_state is None:
        raise CheckpointError(f"checkpoint{f' {path}' if path else ''} holds no model state; pass a checkpoint of a training run")
    if not isinstance(model_state, dict):
        where = f"checkpoint {path} " if path else ""
        raise CheckpointError(f"{where}model state must be a dict (a state_dict), got {type(model_state).__name__}")
    not_tensors = [k for k, v in model_state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        k = not_tensors[0]
        where = f"checkpoint {path}" if path else "checkpoint"
        raise CheckpointError(f"{where} model state {_key(k)} is a {type(model_state[k]).__name__}, not a tensor; "
                              "the file is damaged or not unison's")
    differences = state_differences(model, model_state)
    if not differences:
        _check_finite(model_state, path)
        return
    hint = ""
    expected = model.state_dict()
    if any(k not in expected for k in model_state) and all(str(k).startswith("module.") for k in model_state):
        hint = "; the checkpoint keys start with 'module.' (a DDP wrapper): save model.module.state_dict()"
    raise CheckpointError("checkpoint does not match the model: " + "; ".join(differences) + hint)


def state_differences(model: torch.nn.Module, state: dict, where: str = "the checkpoint",
                      into: str = "the model") -> list[str]:
    """How tensor state dict `state` differs from `model`'s (missing and unexpected keys, other shapes, another kind
    of dtype), as a few short phrases; [] when it loads strictly. `where`/`into`: what the two are called (keys
    missing from `where`, unexpected in `into`)."""
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{'parameter' if k in params else 'buffer'} {_key(k)} has shape {_fmt_shape(v.shape)} in {where} "
        f"but {_fmt_shape(expected[k].shape)} in {into}"
        for k, v in state.items()
        if k in expected and isinstance(expected[k], torch.Tensor) and v.shape != expected[k].shape
    ]
    mismatched += [
        f"{_key(k)} has dtype {v.dtype} in {where} but {expected[k].dtype} in {into}"
        for k, v in state.items()
        if k in expected and isinstance(expected[k], torch.Tensor)
        and (v.is_floating_point(), v.is_complex(), v.dtype == torch.bool)
        != (expected[k].is_floating_point(), expected[k].is_complex(), expected[k].dtype == torch.bool)
    ]   # float32 <-> float64 is a precision change load_state_dict makes; int weights in a float layer are damage
    parts = []
    named = (where, into) != ("the checkpoint", "the model")
    if missing:
        parts.append(_few(missing, f"key of {into} missing from {where}", f"keys of {into} missing from {where}")
                     if named else _few(missing, "missing key"))
    if unexpected:
        parts.append(_few(unexpected, f"key of {where} unknown to {into}", f"keys of {where} unknown to {into}")
                     if named else _few(unexpected, "unexpected key"))
    parts += mismatched[:3]
    if len(mismatched) > 3:
        parts.append(f"{len(mismatched) - 3} more shape mismatches")
    return parts


def _check_finite(model_state: dict, path: object) -> None:
    """NaN or infinite weights (a diverged run's last save, a damaged file) would train or export as NaN."""
    for k, v in model_state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            where = f"checkpoint {path}" if path else "checkpoint"
            raise CheckpointError(f"{where} model state {_key(k)} holds NaN or infinite values; "
                                  "use an earlier checkpoint")
