"""A run's model: the backbone (unison's or the user's own; ``--init`` weights loaded, ``--freeze`` and
``--layer-decay`` checked against it, `unison.training.init`), distill's frozen teacher (`unison.training.teacher`),
and the method built around them, seeded identically on every rank. `unison.training.step.build_run` wraps it
(SyncBN, channels_last, DDP/FSDP); `unison.training.load`, the memory estimate (`unison.training.preflight`),
``unison plan`` and the benchmarks build it alone."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.losses import keep_losses_eager
from unison.methods import get_method
from unison.methods.base import SSLMethod
from unison.models import build_backbone
from unison.models.backbones import resolve_backbone
from unison.training.init import InitWeights, prepare_backbone
from unison.training.resolve import needs_teacher, resolve_recipe, resumes_its_teacher

__all__ = ["CompileFailuresReported", "build_method", "compiled", "seed_everything"]


def _method_named(method: str, params: dict[str, Any]) -> str:
    """The method as a message names it: with the ``--param`` values given, if any (no empty ``{}``)."""
    if not params:
        return method
    return f"{method} with --param {', '.join(f'{k}={v!r}' for k, v in params.items())}"


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile(model)`` with the float32 losses kept eager in it (`unison.losses.keep_losses_eager`: Triton
    can fail to compile them), a failure to compile reported as one line (`CompileFailuresReported`), and two of
    torch's log lines that tell a user nothing silenced (`_quiet_compile_logs`). torch.compile of a Module returns
    an OptimizedModule, an nn.Module; its stubs say only Callable."""
    keep_losses_eager()
    _quiet_compile_logs()
    return CompileFailuresReported(cast(nn.Module, torch.compile(model)))


class CompileFailuresReported(nn.Module):
    """Calls a compiled model; when torch.compile cannot build its kernels (no C++ compiler or no ``Python.h`` on
    a CPU, a Triton failure on a GPU: raised at the first call, as 100 lines of traceback) the run ends with one
    line that names the cause and the way out."""

    def __init__(self, compiled_model: nn.Module):
        super().__init__()
        self.compiled_model = compiled_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled_model(*args, **kwargs)
        except Exception as exc:
            if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise   # the model's own error (a NaN check, bad data): it says what it is itself
            raise ConfigError(f"--compile failed: torch.compile could not build this model's kernels "
                              f"({_cause_of(exc)}); on a CPU it needs a C++ compiler and Python's headers (e.g. apt-get "
                              "install g++ python3-dev), on a GPU a working Triton; or run without --compile "
                              "(--no-compile)") from None


def _cause_of(exc: Exception) -> str:
    """The line of a compile failure that says what went wrong: the compiler's first ``error:`` line, else the
    message's first line."""
    import re

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    compiler = next((m.group(0) for m in map(re.compile(r"(\w+ )?error: .*").search, lines) if m), None)
    return (compiler or (lines[0] if lines else type(exc).__name__))[:200]


class _DropLines:
    """A logging filter that drops records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _quiet_compile_logs() -> None:
    """Silence torch's warnings, under --compile, that a profiler label inside the model is ignored and that a
    CPU-only machine has no CUDA runtime: both printed on every rank of every compiled run, neither about the user's
    run."""
    import logging

    for name, prefix in (("torch._dynamo.variables.ctx_manager", "Profiler record function"),
                         ("torch.utils.cpp_extension", "No CUDA runtime is found")):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines((prefix,)))


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator the build uses, identically on every rank (same initialisation everywhere), and set
    how cuDNN picks its convolution algorithms: timed, the fastest; `deterministic`: torch's repeatable choice."""
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    # cuDNN times its convolution algorithms at each new shape and keeps the fastest: an SSL run's shapes are
    # fixed (one or two view sizes), so that is paid in its first steps; a deterministic run keeps torch's choice
    torch.backends.cudnn.benchmark = not deterministic


def build_method(cfg: TrainConfig, total_steps: int, dtype: torch.dtype, device: torch.device,
                 image_size: int | None = None, backbone: str | None = None,
                 view_sizes: Sequence[int] = (), setup: dict[str, Any] | None = None,
                 init: InitWeights | None = None, teacher_weights: bool | None = None,
                 data_size: int | None = None, own: tuple[nn.Module, int] | None = None,
                 kept: dict[str, nn.Module] | None = None) -> SSLMethod:
    """backbone -> method with its hyper-parameters, seeded identically on every rank. `image_size` (the
    training crop size) picks the ResNet stem of ``resnet18``/``resnet50`` and sizes timm models that take one;
    `view_sizes` (the augmenter's) are checked against a ViT's patches and make a timm ViT take them all.
    `own`: the user's (backbone, feature_dim), built around a copy (the object passed stays as it was).
    `setup` (a training run's): `init` (``--init``'s tensors) is loaded into the backbone before the method is built
    around it, ``--freeze``/``--layer-decay`` checked against it (`unison.training.init.prepare_backbone`), and
    what was done is recorded in `setup`; with `kept` (a dict) and `init`, ``kept["random"]`` is a copy of the
    backbone before the load: the encoder this run would start from without ``--init`` (the same seed), whose kNN
    is the run's random-initialisation baseline.
    A method with a frozen teacher (distill) gets it built first (`unison.training.teacher`; `teacher_weights`
    False: the architecture only, for a checkpoint that holds it; None: False when the run resumes), then the
    seed is set again: the student starts as it would without a teacher; `data_size` (training images) sizes its
    automatic queue."""
    method_cls = get_method(cfg.method)
    extra: dict[str, Any] = {}
    if needs_teacher(cfg.method):
        from unison.training.teacher import build_teacher  # it reads checkpoints and weights files: distill only

        seed_everything(cfg.seed, cfg.deterministic)
        if teacher_weights is None:   # a resumed run's checkpoint holds its teacher's weights: not read again
            teacher_weights = not resumes_its_teacher(cfg)
        teacher, teacher_dim, head = build_teacher(cfg, image_size or cfg.image_size, weights=teacher_weights,
                                               dtype=dtype)
        extra = {"teacher": teacher, "teacher_dim": teacher_dim, "data_size": data_size, "teacher_head": head}
    seed_everything(cfg.seed, cfg.deterministic)
    name, size = backbone or resolve_recipe(cfg).backbone, image_size or cfg.image_size
    if own is not None:
        encoder, feature_dim = copy.deepcopy(own[0]), own[1]
    else:
        encoder, feature_dim = build_backbone(name, size, backbone_args=cfg.backbone_args, view_sizes=view_sizes)
        name = resolve_backbone(name, size)
    encoder.to(dtype)   # before --init's tensors are read into it: a float64 run keeps float64 weights' digits
    try:
        params = method_cls.Params(**cfg.method_params)
        if own is None:   # the method's initialisation of the backbone unison built; --init's weights, read next, win
            method_cls.init_backbone(encoder, params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_method_named(cfg.method, cfg.method_params)}: {exc}") from None
    if kept is not None and init is not None:
        kept["random"] = copy.deepcopy(encoder)
    if setup is not None:
        setup.update(prepare_backbone(encoder, cfg, name, init))
    try:
        method = method_cls(encoder, feature_dim, params, gather_distributed=cfg.distributed.gather_distributed,
                            shared_queue=cfg.distributed.shared_queue, steps_total=total_steps, **extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_method_named(cfg.method, cfg.method_params)}: {exc}") from None
    method_cls.check_views(params, getattr(encoder, "patch_size", None), view_sizes)   # as the pre-flight does
    method = method.to(device, dtype)
    if extra and cfg.teacher_dtype == "bf16":   # after .to(dtype), which would undo it (the head too)
        for module in (extra["teacher"], extra["teacher_head"]):
            if module is not None:
                module.to(torch.bfloat16)
    return method
