"""Per-block learning rates (``--layer-decay``) and frozen blocks (``--freeze``) for continued pre-training.

A backbone parameter's *block id* (`block_id`), as BEiT / MAE / DINOv2 fine-tuning number them:

* 0: the input side: a ViT's ``patch_embed``, ``cls_token``, ``pos_embed``, ``reg_token``, ``mask_token``; a
  ResNet's stem ``conv1``/``bn1``; a timm model's ``stem`` or ``conv_stem``;
* ``i + 1`` for a ViT's ``blocks.i`` (also timm's ``stages.i`` / ``layers.i``); ``i`` for a ResNet's ``layer{i}``;
  the small CNN's ``features.k``: its conv-BN-ReLU block ``k // 3``;
* the rest (a final ``norm``, anything after the blocks): ``depth + 1``, where ``depth`` is the highest block id.

`layer_scales(names, decay)` gives each parameter the factor ``decay ** (depth + 1 - id)`` of the learning rate
(MAE's ``param_groups_lrd``: the last block ``decay``, the embeddings ``decay ** (depth + 1)``, the final norm 1);
parameters outside the backbone (projection heads, predictors, prototypes) keep the full rate. `param_groups`
groups the trainable parameters by factor; each group carries it as ``"lr_scale"``, and the training step sets
``group["lr"] = schedule(step) * group["lr_scale"]``, so warm-up and cosine decay apply to every group alike.

`frozen_names(names, spec)`: the parameters ``--freeze SPEC`` freezes. SPEC is a comma-separated list of

* an integer ``N``: the input side and the first ``N`` blocks (block ids 0 to N; ``0``: the input side only);
* ``all``: the whole backbone;
* a module or parameter name of the backbone (``patch_embed``, ``blocks.0``, ``layer1``, ``cls_token``).

A batch norm whose weight and bias are both frozen is held in eval mode (running statistics, not updated), as
mmdetection's ``frozen_stages``; one without parameters (``affine=False``) is left as it is.

Both take plain names and values (not the training configuration) and raise one-line `ConfigError`s.

Example::

    scales = layer_scales([n for n, _ in vit.named_parameters()], 0.75)   # {"blocks.11.mlp.fc2.bias": 0.75, ...}
    frozen = frozen_names([n for n, _ in vit.named_parameters()], "patch_embed,4")
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch.nn as nn

from unison.config.fields import ascii_digits, did_you_mean
from unison.distributed.sync_batchnorm import hold_running_statistics
from unison.errors import ConfigError

_INPUT = re.compile(r"^(patch_embed|cls_token|pos_embed|reg_token|mask_token|conv1|bn1|stem|conv_stem)(\.|$)")
_BLOCKS = re.compile(r"^(?:blocks|stages|layers)\.(\d+)(\.|$)")
_RESNET = re.compile(r"^layer(\d+)(\.|$)")
_CNN = re.compile(r"^features\.(\d+)(\.|$)")
MAX_SPEC_ITEMS = 64


def block_id(name: str) -> int | None:
    """The block id of backbone parameter `name` (see the module docstring); None: after the blocks."""
    if _INPUT.match(name):
        return 0
    for pattern, of in ((_BLOCKS, lambda i: i + 1), (_RESNET, lambda i: i), (_CNN, lambda i: i // 3)):
        m = pattern.match(name)
        if m:
            return int(of(int(m.group(1))))
    return None


def _depth(names: Sequence[str], what: str) -> int:
    """The highest block id of `names`; one line when the backbone has no numbered blocks."""
    ids = [i for i in map(block_id, names) if i is not None]
    if not ids or max(ids) == 0:
        raise ConfigError(f"{what} needs a backbone with numbered blocks (a ViT's blocks.N, a ResNet's layerN, the "
                          f"small CNN's features); this one has {', '.join(sorted(_top(names))[:8])}")
    return max(ids)


def _top(names: Iterable[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def check_layer_decay(decay: float) -> None:
    """``--layer-decay`` is in (0, 1] (1: every block the same rate)."""
    if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 < decay <= 1:
        raise ConfigError(f"--layer-decay {decay!r} must be a number in (0, 1] (0.65 to 0.75 in MAE/BEiT fine-tuning; "
                          "1: no decay)")


def layer_scales(names: Sequence[str], decay: float) -> dict[str, float]:
    """Each backbone parameter's learning-rate factor ``decay ** (depth + 1 - block id)``."""
    check_layer_decay(decay)
    depth = _depth(names, "--layer-decay")
    return {n: float(decay ** (0 if (i := block_id(n)) is None else depth + 1 - i)) for n in names}


def parse_freeze(spec: str) -> list[str]:
    """The items of ``--freeze SPEC`` (syntax only: the names are checked against the backbone by `frozen_names`)."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else []
    if not items or any(not s or len(s) > 200 or not s.isprintable() for s in items) or len(items) > MAX_SPEC_ITEMS:
        raise ConfigError(f"--freeze {str(spec)[:80]!r} is not a list of block counts or module names; give e.g. "
                          "--freeze 4 (the input side and the first 4 blocks), --freeze patch_embed,blocks.0 or "
                          "--freeze all")
    return items


def frozen_names(names: Sequence[str], spec: str) -> set[str]:
    """The backbone parameters that ``--freeze SPEC`` freezes (see the module docstring)."""
    out: set[str] = set()
    for item in parse_freeze(spec):
        if item == "all":
            out.update(names)
        elif ascii_digits(item):   # '²' is a name (that names nothing), not a count
            depth = _depth(names, "--freeze N")
            if int(item) > depth:
                raise ConfigError(f"--freeze {item}: the backbone has {depth} blocks; give at most {depth} (or 'all')")
            out.update(n for n in names if (i := block_id(n)) is not None and i <= int(item))
        else:
            hit = {n for n in names if n == item or n.startswith(item + ".")}
            if not hit:
                raise ConfigError(f"--freeze {item!r} names no part of the backbone{did_you_mean(item, _modules(names))}; "
                                  f"its parts: {', '.join(sorted(_top(names), key=_natural)[:12])}")
            out |= hit
    return out


def _modules(names: Iterable[str]) -> set[str]:
    """Every dotted prefix of `names` (``blocks``, ``blocks.0``, ``blocks.0.attn``, ...)."""
    out: set[str] = set()
    for n in names:
        parts = n.split(".")
        out.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return out


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if ascii_digits(p) else p for p in re.split(r"([0-9]+)", name))


def freeze(backbone: nn.Module, spec: str) -> list[str]:
    """Set ``requires_grad=False`` on the parameters `spec` names (before SyncBN, DDP/FSDP wrapping), and hold
    every batch norm whose parameters all are frozen in eval mode (`hold_running_statistics`: its running statistics
    are neither used from the batch nor updated, so a frozen block is a fixed function); returns the parameters."""
    names = [n for n, _ in backbone.named_parameters()]
    chosen = frozen_names(names, spec)
    for n, p in backbone.named_parameters():
        if n in chosen:
            p.requires_grad_(False)
    for prefix, module in backbone.named_modules():
        own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and own and all(n in chosen for n in own):
            hold_running_statistics(module)
    return [n for n in names if n in chosen]


def param_groups(named: Iterable[tuple[str, nn.Parameter]], scales: dict[str, float],
                 prefix: str = "backbone.") -> list[dict[str, Any]]:
    """The trainable parameters of `named` (a method's ``named_parameters()``) grouped by learning-rate factor:
    ``scales[name without prefix]`` for the backbone's, 1 for the others; groups in decreasing factor."""
    groups: dict[float, list[nn.Parameter]] = {}
    for name, p in named:
        if p.requires_grad:
            key = name[len(prefix):] if name.startswith(prefix) else None
            groups.setdefault(scales.get(key, 1.0) if key is not None else 1.0, []).append(p)
    return [{"params": ps, "lr_scale": s} for s, ps in sorted(groups.items(), key=lambda kv: -kv[0])]
