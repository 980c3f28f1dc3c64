"""The `unison` command: train, check, eval, export.

Options are generated from the configuration dataclasses (`TrainConfig`,
`DistributedConfig`, `CheckSpec`), so ``--help`` shows every option with its default and
there is no second copy of the defaults. Precedence: dataclass defaults < ``--config
FILE.yaml`` (or the resumed run's config) < command-line flags.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.config.distributed import DistributedConfig
from unison.config.fields import add_dataclass_arguments, overrides_from_namespace
from unison.errors import ConfigError, UnisonError, WatchdogTimeout
from unison.training.resolve import validate_run
from unison.training.runlog import append_run_log

if TYPE_CHECKING:   # annotations only: the commands import what they run when called (fast --help)
    from unison.config import TrainConfig
    from unison.equivalence import CheckReport, CurvesReport

SUBCOMMAND_MODULES = ("unison.evaluation", "unison.export", "unison.bench.commands")


def yaml_error(exc: Exception) -> str:
    """A YAML error as one line with its position: "line 2, column 5: expected ',' or ']' (while parsing ...)"."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} that starts at line {context_mark.line + 1})"
    return where + " ".join(problem.split())


def parse_assignments(items: list[str] | None, flag: str, example: str) -> dict[str, Any]:
    """``NAME=VALUE`` items, each VALUE read as YAML (``0.2``, ``true``, ``[1, 2]``; never a Python object)."""
    import yaml

    values: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"{flag} {item!r} must look like NAME=VALUE, e.g. {flag} {example}")
        key, value = item.split("=", 1)
        try:
            values[key.strip()] = yaml.safe_load(value)   # safe_load: a value never constructs Python objects
        except yaml.YAMLError as exc:
            raise ConfigError(f"{flag} {key.strip()}={value!r} is not a value ({yaml_error(exc)}); give a number, "
                              f"true/false, a string or a [list], e.g. {flag} {example}") from None
    return values


def _parse_params(items: list[str] | None) -> dict[str, Any]:
    return parse_assignments(items, "--param", "temperature=0.2")


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text())  # safe_load: a config file never constructs Python objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML at {yaml_error(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values "
                          "(see examples/simclr_cifar10.yaml)")
    return data


def _config_file(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` file's mapping: read once per command (kept on `ns`), a fresh copy for every caller."""
    if getattr(ns, "config_file_data", (None,))[0] != ns.config:
        ns.config_file_data = (ns.config, _load_yaml(ns.config))
    return copy.deepcopy(ns.config_file_data[1])


def _resume_base(resume: str) -> dict[str, Any]:
    from unison.training.checkpoint import read_header

    return dict(read_header(resume).config)   # the header only: the worker reads the weights, once


def build_train_config(ns: argparse.Namespace) -> TrainConfig:
    from unison.config import TrainConfig

    base: dict[str, Any] = {}
    resume = getattr(ns, "resume", None)
    if resume:
        base = _resume_base(resume)
        base.pop("resume", None)
        if Path(resume).is_dir():
            base["out"] = str(resume)
    if ns.config:
        file_cfg = _config_file(ns)
        dist_file = file_cfg.pop("distributed", None) or {}
        base.update(file_cfg)
        base["distributed"] = {**base.get("distributed", {}), **dist_file}
    base.update(overrides_from_namespace(ns, TrainConfig))
    dist_over = overrides_from_namespace(ns, DistributedConfig)
    base["distributed"] = {**base.get("distributed", {}), **dist_over}
    params = _parse_params(ns.param)
    if params:
        base["method_params"] = {**base.get("method_params", {}), **params}
    backbone_args = parse_assignments(getattr(ns, "backbone_arg", None), "--backbone-arg", "drop_path_rate=0.1")
    if backbone_args:
        base["backbone_args"] = {**base.get("backbone_args", {}), **backbone_args}
    cfg = TrainConfig.from_dict(base)
    if resume:
        cfg.resume = resume
    return validate_run(cfg)


def parse_train_args(argv: list[str]) -> TrainConfig:
    """The `TrainConfig` that ``unison train ARGV`` would run (flags, ``--config``, ``--param``, ``--resume``)."""
    ns = make_parser().parse_args(["train", *argv])
    return build_train_config(ns)


def _check_config_types(data: dict[str, Any], cls: type, where: str) -> None:
    """Refuse a config-file value of the wrong type, naming the option (instead of a TypeError later).

    Numbers written as strings (``lr: 1e-3``, which YAML 1.1 reads as a string) are accepted where a number is due."""
    import typing

    from unison.config.fields import article, base_type, coerce_fields, type_error

    data = coerce_fields(cls, data)
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        typ = base_type(hints[key]) if key in hints else None
        if isinstance(typ, type) and dataclasses.is_dataclass(typ) and value is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a mapping of {key} options, got {value!r}")
            _check_config_types(value, typ, f"{where}{key}.")
    bad = type_error(data, cls)
    if bad:
        raise ConfigError(f"{where}{bad[0]}={bad[1]!r} must be {article(bad[2])} {bad[2]}")


def cmd_train(ns: argparse.Namespace) -> int:
    from unison.api import train
    from unison.distributed.env import detect_launch_env
    from unison.training.checkpoint import latest_checkpoint

    if getattr(ns, "config", None):  # wrong value types would otherwise surface as TypeErrors deep in validate()
        from unison.config import TrainConfig

        _check_config_types(_config_file(ns), TrainConfig, f"config file {ns.config}: ")
    if getattr(ns, "resume", None) == "auto":  # --resume auto: continue the run in --out if it has a checkpoint
        ns.resume = None
        out = build_train_config(ns).out
        ns.resume = out if latest_checkpoint(out) is not None else None
    cfg = build_train_config(ns)
    if cfg.resume == "auto":  # `resume: auto` in a YAML file: the file's options stand, weights come from --out
        cfg.resume = cfg.out if latest_checkpoint(cfg.out) is not None else None
    launch_env = detect_launch_env()
    if launch_env is not None:
        _check_world_size(ns, launch_env)
    started = time.perf_counter()
    with _stop_before_training():
        try:
            summary = train(cfg)   # a WorkerFailure goes to main(), which prints it as one line
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_where_to_continue(cfg.out)) from None
        except WatchdogTimeout as exc:
            if launch_env is None or launch_env.rank == 0:
                append_run_log(cfg.out, f"unison: error: {' '.join(str(exc).split())}")
            raise WatchdogTimeout(f"{exc}; {_where_to_continue(cfg.out)}") from None
        except UnisonError as exc:
            if launch_env is None or launch_env.rank == 0:
                append_run_log(cfg.out, f"unison: error: {' '.join(str(exc).split())}")
            raise
    if launch_env is None or launch_env.rank == 0:   # under torchrun/srun/mpirun: rank 0 prints the result
        line = summary.result_line(time.perf_counter() - started)
        print(line, flush=True)
        append_run_log(cfg.out, line)
    return 0


def _where_to_continue(out: str) -> str:
    """Where the last complete checkpoint of run directory `out` is, and how to continue from it."""
    from unison.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(out)
    if last is None:
        return f"no checkpoint was written in {out}"
    return f"the last checkpoint is {last}; continue with --resume auto --out {out}"


@contextlib.contextmanager
def _stop_before_training():
    """SIGTERM/SIGUSR1 before the workers run (pre-flight, data scan): end at once with a line, nothing to save.

    Once training runs, the launcher (forwarding) or the training loop (finish the step, checkpoint)
    replace this handler with their own.
    """
    from unison.distributed.signals import STOP_SIGNALS
    from unison.errors import Preempted

    def stop(signum: int, frame: Any) -> None:
        raise Preempted(f"stopped by {signal.Signals(signum).name} before training started: nothing to save; "
                        "run the same command again")

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _explicit_world_size(ns: argparse.Namespace) -> int | None:
    """The world size the user asked for on the command line or in the config file (None: not asked)."""
    if getattr(ns, "world_size", None) is not None:
        return ns.world_size
    if getattr(ns, "config", None):
        dist = _config_file(ns).get("distributed") or {}
        if isinstance(dist, dict) and dist.get("world_size") is not None:
            from unison.config.fields import coerce_value

            return coerce_value(dist["world_size"], int)
    return None


def _check_world_size(ns: argparse.Namespace, launch_env: Any) -> None:
    """Under torchrun/srun/mpirun the launcher decides the world size: refuse a different one asked for."""
    asked = _explicit_world_size(ns)
    if asked is not None and asked != launch_env.world_size:
        launcher, start = {"torchrun": ("torchrun", f"torchrun --nproc-per-node {asked}"),
                           "mpi": ("mpirun", f"mpirun -n {asked}"),
                           "slurm": ("srun", f"srun -n {asked}")}[launch_env.source]
        raise ConfigError(f"--world-size {asked} but {launcher} started {launch_env.world_size} worker processes; "
                          f"the launcher decides the world size: drop --world-size, or start {asked} ({start})")


def cmd_check(ns: argparse.Namespace) -> int:
    from unison.equivalence import CheckSpec, CurveSpec, run_curves_for_check, run_equivalence
    from unison.methods import METHODS

    spec = overrides_from_namespace(ns, CheckSpec)
    curve = overrides_from_namespace(ns, CurveSpec)
    methods = sorted(METHODS) if spec.get("method") == "all" else [spec.pop("method", CheckSpec.method)]
    spec.pop("method", None)
    params = _parse_params(ns.param)
    ok = True
    for m in methods:
        report: CheckReport | CurvesReport
        if curve.get("run"):  # whole `unison train` runs at 1 and W workers, loss curves compared
            report = run_curves_for_check(m, spec, curve, params)
        else:
            report = run_equivalence(m, method_params=params, **spec)
        print(report.summary(), flush=True)
        ok &= report.passed
    return 0 if ok else 1


def make_parser() -> argparse.ArgumentParser:
    from unison.config import TrainConfig
    from unison.equivalence import CheckSpec, CurveSpec

    parser = argparse.ArgumentParser(prog="unison", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="self-supervised pre-training (default: SimCLR on digits, 2 workers)",
                             description="Self-supervised pre-training: W workers with B/W images each, exactly\n"
                                         "equivalent to 1 worker with the global batch B.",
                             epilog=train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p_train.add_argument("--config", metavar="FILE",
                         help="YAML file of options (CLI flags override it); see examples/simclr_cifar10.yaml")
    p_train.add_argument("--param", action="append", metavar="NAME=VALUE",
                         help="method hyper-parameter, repeatable (names and defaults below)")
    p_train.add_argument("--backbone-arg", action="append", metavar="NAME=VALUE",
                         help="setting of a timm backbone, repeatable, e.g. --backbone-arg drop_path_rate=0.1 "
                              "(img_size follows --image-size when the model takes it)")
    add_dataclass_arguments(p_train, TrainConfig, skip=("method_params", "distributed", "backbone_args"))
    add_dataclass_arguments(p_train, DistributedConfig, group_title="distributed", skip=("rank",))
    p_train.add_argument("--shard-optimizer", dest="shard", action="store_const", const="optimizer",
                         default=argparse.SUPPRESS, help="alias of --shard optimizer (ZeRO-1)")
    p_train.set_defaults(func=cmd_train)

    p_check = sub.add_parser("check", help="prove W workers == 1 worker on the global batch (loss, grads, params)")
    p_check.add_argument("--param", action="append", metavar="NAME=VALUE", help="method hyper-parameter")
    add_dataclass_arguments(p_check, CheckSpec, skip=("method_params",))
    add_dataclass_arguments(p_check, CurveSpec, group_title="whole training runs (--run)")
    p_check.set_defaults(func=cmd_check)

    # Further subcommands live beside their concern; each module defines add_subcommand(subparsers).
    import importlib

    for module in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not exc.name or not module.startswith(exc.name):  # a missing module, not a broken one
                raise
            continue
        mod.add_subcommand(sub)
    return parser


def version_text() -> str:
    import platform

    import torch

    from unison.version import __version__

    return f"unison {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def train_epilog(width: int = 100) -> str:
    """The lists `unison train --help` ends with: methods and their --param names, presets, backbones."""
    import dataclasses
    import textwrap

    from unison.data.augment import PRESETS
    from unison.methods import METHODS
    from unison.models.backbones import BACKBONES

    lines = ["methods (--method) and their hyper-parameters (--param NAME=VALUE; defaults shown):"]
    for name in sorted(METHODS):
        defaults = METHODS[name].Params()
        params = " ".join(f"{f.name}={getattr(defaults, f.name)}" for f in dataclasses.fields(defaults))
        lines += textwrap.wrap(params, width, initial_indent=f"  {name:<12} ", subsequent_indent=" " * 15)
    lines.append("")
    lines += textwrap.wrap(f"augmentation presets (--augmentation): {', '.join(sorted(PRESETS))}; default: the "
                           "method's recipe (see README)", width)
    lines += textwrap.wrap(f"backbones (--backbone): {', '.join(BACKBONES)}, timm:<model> (settings with "
                           "--backbone-arg NAME=VALUE)", width)
    lines += textwrap.wrap("A YAML file (--config) takes the same options by their field names (batch_size: 256), "
                           "the distributed ones under 'distributed:', method hyper-parameters under "
                           "'method_params:'; see examples/simclr_cifar10.yaml.", width)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    ns = parser.parse_args(argv)
    code = _run(ns)
    if argv is None and ns.func is cmd_train and _launched_worker():
        from unison.distributed.env import exit_worker

        exit_worker(code)   # a torchrun/srun/mpirun worker: skip interpreter finalization (see exit_worker)
    return code


def _launched_worker() -> bool:
    from unison.distributed.env import detect_launch_env

    try:
        return detect_launch_env() is not None
    except ConfigError:   # already reported as this command's error
        return False


def _run(ns: argparse.Namespace) -> int:
    try:
        return ns.func(ns)
    except KeyboardInterrupt as exc:
        hint = f"; {exc.args[0]}" if exc.args and isinstance(exc.args[0], str) else ""
        print(f"unison: interrupted{hint}", file=sys.stderr)
        return 130
    except Exception as exc:
        # Bad input and failed runs are one line and an exit code; anything else is a bug and keeps its
        # traceback (so does everything with UNISON_DEBUG=1, plus the failed worker's own traceback).
        code = _exit_code(exc)
        if code is None or os.environ.get("UNISON_DEBUG", "") not in ("", "0"):
            worker_traceback = getattr(exc, "traceback", "")   # set by WorkerError: the failed worker's
            if worker_traceback:
                print(worker_traceback, file=sys.stderr)
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
        print(f"unison: error: {where}{text}", file=sys.stderr)  # under torchrun every worker is a main()
        return code


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of a failure the user can act on (`unison.errors`); None for a bug."""
    from unison.distributed.launch import is_comm_error
    from unison.errors import exit_code_of

    if "RANK" in os.environ and isinstance(exc, RuntimeError) and is_comm_error(f"{type(exc).__name__} {exc}"):
        return 1  # under torchrun/srun: this worker lost a peer, whose own failure is the root cause
    return exit_code_of(exc)


if __name__ == "__main__":
    sys.exit(main())
