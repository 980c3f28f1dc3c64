"""Backbone weights from a file: torchvision / timm state dicts, safetensors files and unison exports.

`load_backbone_weights(backbone, path)` copies the tensors of `path` into `backbone` (a plain module, before any
DDP/FSDP wrapping) and returns a `WeightsReport` (tensors matched, head tensors skipped, the kind of file);
`read_backbone_state(path)` gives the file's tensors without a module (a distillation teacher's, ...);
`load_state` does the matching for a state dict already read (a unison checkpoint's ``model``, which the
training layer reads with its own checks).

Reading never runs code from the file: ``.pt``/``.pth`` with ``torch.load(weights_only=True)`` (a pickle naming
a function, a crafted ``__reduce__``, is refused), ``.safetensors`` with safetensors. Only a regular file of at
most `MAX_WEIGHTS_BYTES` is read; every key is a bounded printable string and every value a finite, dense tensor
with values (not meta), neither quantised nor float8; a floating-point weight of the backbone takes floating-point
values only (int, bool or complex ones would be cast silently: bool weights start a run collapsed).

Matching, in this order:

* a wrapped state dict is unwrapped: ``{"state_dict": ...}``, ``{"model": ...}``, ``{"module": ...}``,
  ``{"teacher": ...}`` (DINO's checkpoints), also nested;
* the prefix that makes the most keys the backbone's own is stripped (``module.``, ``backbone.``, ``model.``,
  ``encoder.``, ``module.backbone.``, ...: ``module.backbone.conv1.weight`` -> ``conv1.weight``); keys outside it
  are skipped (an SSL checkpoint's projection heads, a momentum encoder);
* keys the backbone lacks that are classifier heads (torchvision ``fc.*``, timm ``head.*``, ``fc.*``,
  ``classifier.*``, ``fc_norm.*``) are skipped;
* a ViT position embedding (``pos_embed``) of another square patch grid (weights trained at another image size)
  is resampled bicubically to the backbone's, as timm does when it loads pretrained weights, and reported;
* any other key the backbone lacks, any backbone tensor the file lacks (batch norm's ``num_batches_tracked``
  excepted) and any other shape that differs is a one-line `CheckpointError` naming the first such tensor and
  what to do (a CIFAR-stem ResNet against torchvision's ImageNet stem: the ``--backbone`` to use; another patch
  size: the backbone with that patch size).

A unison export (`unison export`'s file, with its ``<name>.json`` sidecar) is recognised by the sidecar and
reported with its backbone, method and step.

Example::

    net, dim = build_backbone("resnet18_imagenet")
    report = load_backbone_weights(net, "resnet18-f37072fd.pth")
    report.line()   # "matched 120 tensors of state dict resnet18-f37072fd.pth; skipped: fc.weight, fc.bias"
"""

from __future__ import annotations

import errno
import json
import math
import pickle
import re
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from unison.errors import CheckpointError

MAX_WEIGHTS_BYTES = 1 << 37       # 128 GiB: past the largest public ViT (ViT-22B: 22e9 weights of 2 bytes in bf16)
MAX_TENSORS = 1_000_000           # tensors in one state dict
MAX_KEY = 1000                    # characters of a tensor name
MAX_SIDECAR_BYTES = 1 << 20       # an export's .json sidecar is a few hundred bytes
WRAPPERS = ("state_dict", "model", "module", "teacher")
MAX_PREFIX_PARTS = 4              # module.model.backbone.encoder.conv1.weight: the deepest wrapping stripped
HEAD = re.compile(r"^(fc|head|heads|classifier|fc_norm|head_drop|pre_logits)(\.|$)")


@dataclass
class WeightsReport:
    """What `load_backbone_weights` loaded: `matched` tensors, `skipped` keys (heads, other modules), `source`."""

    path: str
    source: str                       # "torchvision/timm state dict", "safetensors", "unison export of ...", ...
    matched: int = 0
    skipped: list[str] = field(default_factory=list)
    prefix: str = ""                  # the prefix stripped from the file's keys ("module.backbone.")
    sha256: str = ""                  # of the tensors loaded (names, dtypes, shapes, bytes): what a run records
    resampled: list[str] = field(default_factory=list)   # position embeddings resampled to the backbone's grid

    def line(self) -> str:
        """One line for the run's start: what was loaded from where, and what was left out."""
        skipped = ", ".join(self.skipped[:6]) + (f" and {len(self.skipped) - 6} more" if len(self.skipped) > 6 else "")
        strip = f" (prefix {self.prefix!r} stripped)" if self.prefix else ""
        resampled = f"; resampled {', '.join(self.resampled)}" if self.resampled else ""
        return (f"matched {self.matched} tensors of {self.source} {self.path}{strip}; "
                f"skipped: {skipped or 'none'}{resampled}")


def _fail(option: str, path: str | Path, what: str) -> CheckpointError:
    return CheckpointError(f"{option} {path}: {what}")


def _check_file(path: Path, option: str) -> int:
    """The size of regular file `path`; one line for a missing, special or oversized file."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _fail(option, path, "no such file; give a .pt/.pth/.safetensors weights file, a unison export "
                                  "or a unison run directory") from None
    except OSError as e:
        raise _fail(option, path, f"cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(info.st_mode):
        raise _fail(option, path, "is a directory that is not a unison run; give a weights file")
    if not stat.S_ISREG(info.st_mode):   # a FIFO would block the read, a device never end it
        raise _fail(option, path, "is not a regular file (a device, pipe or socket); give a weights file")
    if info.st_size == 0:
        raise _fail(option, path, "is empty (0 bytes); give a weights file")
    if info.st_size > MAX_WEIGHTS_BYTES:
        raise _fail(option, path, f"is {info.st_size} bytes, past the {MAX_WEIGHTS_BYTES >> 30} GiB a weights "
                                  "file may have; is it the right file?")
    return info.st_size


def _magic(path: Path, n: int = 9) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _is_safetensors(path: Path, head: bytes) -> bool:
    """safetensors: an 8-byte little-endian header length, then the JSON header (``{``)."""
    return path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{" and not head.startswith(b"PK"))


def _read_safetensors(path: Path, option: str) -> dict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise _fail(option, path, "reading .safetensors needs safetensors: pip install safetensors") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorError, OSError: a damaged or foreign file
        raise _fail(option, path, f"is not a readable safetensors file ({_reason(e)})") from None


def _read_torch(path: Path, option: str) -> Any:
    try:
        with warnings.catch_warnings():   # torch warns about a plain pickle's protocol before refusing it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=_magic(path, 2) == b"PK")
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL [\w.]+", str(e))
        if "weights only" in str(e).lower():
            what = f" ({found.group(0)})" if found else ""
            raise _fail(option, path, f"refused: it holds Python objects that could run code when unpickled{what}; "
                                      "give a plain state dict (torch.save(model.state_dict(), ...)) or a "
                                      ".safetensors file") from None
        raise _fail(option, path, f"is truncated or not a weights file ({_reason(e)})") from None
    except OSError as e:
        if e.errno == errno.EINVAL:   # torch's zip reader seeking before the start of a short (truncated) file
            raise _fail(option, path, f"is truncated or not a weights file ({_reason(e)})") from None
        raise _fail(option, path, f"cannot be read ({e.strerror or e})") from None
    except Exception as e:  # RuntimeError (zip), EOFError, ...: damage
        raise _fail(option, path, f"is truncated or not a weights file ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text.split('. ')[0]}"[:160] if text else type(e).__name__


def export_info(path: Path) -> dict[str, Any] | None:
    """The sidecar ``<stem>.json`` of a unison export (`unison.export`), when it names `path`; else None."""
    sidecar = path.with_suffix(".json")
    try:
        if not sidecar.is_file() or sidecar.stat().st_size > MAX_SIDECAR_BYTES:
            return None
        info = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(info, dict) and info.get("unison") == "backbone" and info.get("file") == path.name:
        return info
    return None


def describe_file(path: str | Path) -> str:
    """What weights file `path` is, for the report: ``state dict``, ``safetensors file`` or ``unison export (...)``."""
    path = Path(path)
    info = export_info(path)
    if info is None:
        return "safetensors file" if _is_safetensors(path, _magic(path)) else "state dict"
    bits = [str(info.get(k))[:64] for k in ("backbone", "method") if isinstance(info.get(k), str)]
    step = info.get("step")
    return f"unison export ({', '.join(bits)}{f', step {step}' if isinstance(step, int) else ''})"


def unwrap(obj: Any, path: str | Path, option: str = "--init") -> dict[str, torch.Tensor]:
    """The state dict inside `obj` (a wrapper such as ``{"state_dict": {...}}`` unwrapped), every key a bounded
    printable string and every value a finite tensor; one line otherwise."""
    for _ in range(4):   # nested wrappers: {"model": {"state_dict": ...}}
        if not isinstance(obj, dict):
            break
        inner = next((obj[k] for k in WRAPPERS if isinstance(obj.get(k), dict)), None)
        if inner is None or all(isinstance(v, torch.Tensor) for v in obj.values()):
            break
        obj = inner
    if not isinstance(obj, dict) or not obj:
        raise _fail(option, path, f"holds {'an empty mapping' if isinstance(obj, dict) else type(obj).__name__}, "
                                  "not a state dict of tensors; give torch.save(model.state_dict(), ...)'s file")
    if len(obj) > MAX_TENSORS:
        raise _fail(option, path, f"holds {len(obj)} entries, past the {MAX_TENSORS} a state dict may have")
    state: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isprintable():
            raise _fail(option, path, f"has an entry named {str(key)[:60]!r}, not a tensor name; is it a state dict?")
        if not isinstance(value, torch.Tensor):
            raise _fail(option, path, f"entry {key!r} is a {type(value).__name__}, not a tensor; give a state dict "
                                      "of tensors")
        problem = _storage_problem(value)
        if problem:
            raise _fail(option, path, f"tensor {key!r} {problem}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise _fail(option, path, f"tensor {key!r} holds NaN or infinite values; the file is damaged")
        state[key] = value
    return state


def _storage_problem(value: torch.Tensor) -> str | None:
    """What makes `value` no weights to copy into a model: no values (meta), or a storage that torch cannot
    check or cast like dense float (sparse, quantised, float8); None for an ordinary dense tensor."""
    if value.is_meta:
        return ("is on the meta device: it holds no values (a model built on 'meta' was saved); save the weights of "
                "a materialised model")
    if value.layout != torch.strided:
        return f"is a sparse tensor ({value.layout}); give dense weights (tensor.to_dense())"
    if value.is_quantized:
        return f"is quantised ({value.dtype}); give float weights (tensor.dequantize())"
    if value.is_floating_point() and value.element_size() == 1:
        return f"is {value.dtype}, an 8-bit float; give float16, bfloat16 or float32 weights (tensor.float())"
    return None


def read_backbone_state(path: str | Path, option: str = "--init") -> dict[str, torch.Tensor]:
    """The tensors of weights file `path` (.pt/.pth/.safetensors, a unison export), unwrapped, no prefix stripped."""
    path = Path(path)
    _check_file(path, option)
    head = _magic(path)
    raw = _read_safetensors(path, option) if _is_safetensors(path, head) else _read_torch(path, option)
    return unwrap(raw, path, option)


def load_backbone_weights(backbone: nn.Module, path: str | Path, *, option: str = "--init",
                          name: str | None = None) -> WeightsReport:
    """Copy the weights of file `path` into `backbone` (unwrapped: before DDP/FSDP). `option` and `name` (the
    backbone's name, e.g. ``resnet18_cifar``) make the messages; raises `CheckpointError` (one line)."""
    state = read_backbone_state(path, option)
    return load_state(backbone, state, str(path), describe_file(path), option=option, name=name)


def _strip(state: dict[str, torch.Tensor], target: set[str]) -> tuple[dict[str, torch.Tensor], str, list[str]]:
    """`state` with the prefix (up to `MAX_PREFIX_PARTS` dotted parts) that makes the most keys `target`'s stripped;
    its keys outside that prefix, by their names in the file. Ties: no prefix, else the first in the file."""
    hits: dict[str, int] = {}
    for key in state:
        parts = key.split(".")
        for n in range(min(MAX_PREFIX_PARTS, len(parts) - 1) + 1):
            if ".".join(parts[n:]) in target:
                prefix = "".join(p + "." for p in parts[:n])
                hits[prefix] = hits.get(prefix, 0) + 1
    if not hits or hits.get("", 0) >= max(hits.values()):
        return state, "", []
    best = max(hits, key=lambda p: hits[p])   # the first of the most hits, in the file's order
    kept = {k[len(best):]: v for k, v in state.items() if k.startswith(best)}
    return kept, best, [k for k in state if not k.startswith(best)]


def load_state(backbone: nn.Module, state: dict[str, torch.Tensor], path: str, source: str, *,
               option: str = "--init", name: str | None = None) -> WeightsReport:
    """Match `state` (unwrapped, see `unwrap`) to `backbone`'s tensors and copy it in; see the module docstring."""
    own = backbone.state_dict()
    state, prefix, dropped = _strip(state, set(own))
    extra = [k for k in state if k not in own]
    heads = [k for k in extra if HEAD.match(k)]
    others = [k for k in extra if not HEAD.match(k)]
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    if missing or others:
        raise _fail(option, path, _missing_text(missing, others, own, state, prefix, name))
    state, resampled = dict(state), []
    for k, v in list(state.items()):
        if k in own and tuple(v.shape) != tuple(own[k].shape):
            grids = _pos_embed_grids(k, tuple(v.shape), tuple(own[k].shape))
            if grids is None:
                raise _fail(option, path, _shape_text(k, tuple(v.shape), tuple(own[k].shape), own, name))
            state[k] = resample_pos_embed(v, *grids)
            resampled.append(f"{k} from {grids[1]}x{grids[1]} to {grids[2]}x{grids[2]} patches")
    for k, target in own.items():   # int, bool or complex values cast into float weights: silently other weights
        if k in state and target.is_floating_point() and not state[k].is_floating_point():
            raise _fail(option, path, f"tensor {k!r} is {state[k].dtype} where the backbone's is {target.dtype}; "
                                      "integer, bool and complex values would be cast (bool weights start the run "
                                      "collapsed): give floating-point weights")
    with torch.no_grad():
        for k, target in own.items():
            if k in state:
                target.copy_(state[k].to(device=target.device, dtype=target.dtype))
    return WeightsReport(path=path, source=source, matched=sum(1 for k in own if k in state),
                         skipped=[prefix + k for k in heads] + dropped, prefix=prefix, resampled=resampled,
                         sha256=tensors_sha256({k: state[k] for k in own if k in state}))


def _pos_embed_grids(key: str, got: tuple[int, ...], want: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(prefix tokens, file's grid, backbone's grid) when `key` is a ViT position embedding [1, prefix + g * g, D]
    that differs only in its square patch grid (the weights were trained at another image size); else None."""
    if not (key.split(".")[-1] == "pos_embed" and len(got) == len(want) == 3 and got[0] == want[0] == 1
            and got[2] == want[2]):
        return None
    for prefix in range(0, 9):   # class token, register tokens
        g, w = math.isqrt(max(got[1] - prefix, 0)), math.isqrt(max(want[1] - prefix, 0))
        if g and w and g * g == got[1] - prefix and w * w == want[1] - prefix:
            return prefix, g, w
    return None


def resample_pos_embed(pos: torch.Tensor, prefix: int, grid: int, new_grid: int) -> torch.Tensor:
    """A [1, prefix + grid**2, D] position embedding resampled bicubically (antialiased) to `new_grid`, the prefix
    tokens' kept, as timm's ``resample_abs_pos_embed`` (in float32)."""
    import torch.nn.functional as F

    head, patches = pos[:, :prefix], pos[:, prefix:].float()
    img = patches.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
    img = F.interpolate(img, size=(new_grid, new_grid), mode="bicubic", antialias=True)
    out = img.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, -1).to(pos.dtype)
    return torch.cat([head, out], dim=1)


def tensors_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of `state`'s names, dtypes, shapes and bytes, in its order: the same weights, the same digest,
    whichever file format carried them."""
    import hashlib

    h = hashlib.sha256()
    for k, v in state.items():
        h.update(f"{k}\0{v.dtype}\0{tuple(v.shape)}\0".encode())
        h.update(v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _missing_text(missing: list[str], others: list[str], own: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor], prefix: str, name: str | None) -> str:
    what = f"the backbone {name}" if name else "the backbone"
    if not any(k in own for k in state):
        shown = ", ".join(list(state)[:3])
        return (f"none of its {len(state)} tensors ({shown}, ...) is a tensor of {what} "
                f"(first: {next(iter(own))!r}); is it the weights of this architecture? Give the matching --backbone")
    if missing:
        return (f"has no tensor {prefix + missing[0]!r} that {what} has ({len(missing)} missing); the file is "
                "another architecture (a shallower model, another variant): give the matching --backbone (timm:<name> "
                "for a timm model's weights)")
    return (f"has tensor {prefix + others[0]!r} that {what} lacks ({len(others)} such, not a classifier head); "
            "the file is another architecture (a deeper model, another variant): give the matching --backbone "
            "(timm:<name> for a timm model's weights)")


def _shape_text(key: str, got: tuple[int, ...], want: tuple[int, ...], own: dict[str, torch.Tensor],
                name: str | None) -> str:
    base = f"tensor {key!r} is {list(got)} in the file and {list(want)} in the backbone{f' {name}' if name else ''}"
    arch = (name or "").rsplit("_", 1)[0] if name and name.startswith("resnet") else "resnet18"
    if key == "conv1.weight" and len(got) == 4 and got[-1] == 7 and want[-1] == 3:
        return (f"{base}: the file has torchvision's ImageNet stem (7x7 conv1) and the backbone the CIFAR stem; use "
                f"--backbone {arch}_imagenet (or an --image-size above 64)")
    if key == "conv1.weight" and len(got) == 4 and got[-1] == 3 and want[-1] == 7:
        return (f"{base}: the file has the CIFAR stem (3x3 conv1) and the backbone torchvision's ImageNet stem; use "
                f"--backbone {arch}_cifar (or an --image-size of 64 or less)")
    if key.split(".")[-1] == "pos_embed" and len(got) == 3:
        return (f"{base}: the position embeddings differ in width or in tokens besides a square patch grid; "
                "give the backbone the weights were trained with (its width, class and register tokens)")
    if key == "patch_embed.proj.weight" and len(got) == 4:
        return f"{base}: the file's ViT has {got[-1]} px patches; give the backbone with {got[-1]} px patches"
    return f"{base}; the file is another architecture or width: give the matching --backbone"
