"""The `unison` command: train, check, eval, export.

Options are generated from the configuration dataclasses (`TrainConfig`,
`DistributedConfig`, `CheckSpec`), so ``--help`` shows every option with its default and
there is no second copy of the defaults. Precedence: dataclass defaults < ``--config
FILE.yaml`` (or the resumed run's config) < command-line flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from unison.configutil import add_dataclass_arguments, overrides_from_namespace
from unison.distributed.config import ConfigError, DistributedConfig
from unison.errors import WatchdogTimeout

SUBCOMMAND_MODULES = ("unison.eval.commands", "unison.export", "unison.bench.commands")


def _parse_params(items: list[str] | None) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--param {item!r} must look like NAME=VALUE, e.g. --param temperature=0.2")
        key, value = item.split("=", 1)
        params[key.strip()] = yaml.safe_load(value)
    return params


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text())  # safe_load: a config file never constructs Python objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values")
    return data


def _resume_base(resume: str) -> dict[str, Any]:
    from unison.train.checkpoint import load_checkpoint

    ckpt = load_checkpoint(resume)
    return dict(ckpt["config"])


def build_train_config(ns: argparse.Namespace) -> TrainConfig:  # noqa: F821
    from unison.config import TrainConfig

    base: dict[str, Any] = {}
    resume = getattr(ns, "resume", None)
    if resume:
        base = _resume_base(resume)
        base.pop("resume", None)
        if Path(resume).is_dir():
            base["out"] = str(resume)
    if ns.config:
        file_cfg = _load_yaml(ns.config)
        dist_file = file_cfg.pop("distributed", None) or {}
        base.update(file_cfg)
        base["distributed"] = {**base.get("distributed", {}), **dist_file}
    base.update(overrides_from_namespace(ns, TrainConfig))
    dist_over = overrides_from_namespace(ns, DistributedConfig)
    base["distributed"] = {**base.get("distributed", {}), **dist_over}
    params = _parse_params(ns.param)
    if params:
        base["method_params"] = {**base.get("method_params", {}), **params}
    cfg = TrainConfig.from_dict(base)
    if resume:
        cfg.resume = resume
    return cfg.validate()


def parse_train_args(argv: list[str]) -> TrainConfig:  # noqa: F821
    """The `TrainConfig` that ``unison train ARGV`` would run (flags, ``--config``, ``--param``, ``--resume``)."""
    ns = make_parser().parse_args(["train", *argv])
    return build_train_config(ns)


def _check_config_types(data: dict[str, Any], cls: type, where: str) -> None:
    """Refuse a config-file value of the wrong type, naming the option (instead of a TypeError later)."""
    import typing

    from unison.configutil import _base_type

    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in hints or value is None:  # unknown keys: from_dict names them; None: the default
            continue
        typ = _base_type(hints[key])
        typ = typing.get_origin(typ) or typ
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a mapping of {key} options, got {value!r}")
            _check_config_types(value, typ, f"{where}{key}.")
            continue
        ok = isinstance(value, (int, float) if typ is float else typ) and (typ is bool or not isinstance(value, bool))
        if not ok:
            article = "an" if typ.__name__[0] in "aeiou" else "a"
            raise ConfigError(f"{where}{key}={value!r} must be {article} {typ.__name__}")


def cmd_train(ns: argparse.Namespace) -> int:
    from unison.api import train
    from unison.distributed.env import detect_launch_env
    from unison.train.checkpoint import latest_checkpoint

    if getattr(ns, "config", None):  # wrong value types would otherwise surface as TypeErrors deep in validate()
        from unison.config import TrainConfig

        _check_config_types(_load_yaml(ns.config), TrainConfig, f"config file {ns.config}: ")
    if getattr(ns, "resume", None) == "auto":  # --resume auto: continue the run in --out if it has a checkpoint
        ns.resume = None
        out = build_train_config(ns).out
        ns.resume = out if latest_checkpoint(out) is not None else None
    cfg = build_train_config(ns)
    if cfg.resume == "auto":  # `resume: auto` in a YAML file: the file's options stand, weights come from --out
        cfg.resume = cfg.out if latest_checkpoint(cfg.out) is not None else None
    started = time.perf_counter()
    with _stop_before_training():
        try:
            summary = train(cfg)   # a WorkerFailure goes to main(), which prints it as one line
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_where_to_continue(cfg.out)) from None
        except WatchdogTimeout as exc:
            raise WatchdogTimeout(f"{exc}; {_where_to_continue(cfg.out)}") from None
    launch_env = detect_launch_env()
    if launch_env is None or launch_env.rank == 0:   # under torchrun/srun/mpirun: rank 0 prints the result
        print(summary.result_line(time.perf_counter() - started), flush=True)
    return 0


def _where_to_continue(out: str) -> str:
    """Where the last complete checkpoint of run directory `out` is, and how to continue from it."""
    from unison.train.checkpoint import latest_checkpoint

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


def cmd_check(ns: argparse.Namespace) -> int:
    from unison.check import CheckSpec, CurveSpec, run_curves_for_check, run_equivalence
    from unison.methods import METHODS

    spec = overrides_from_namespace(ns, CheckSpec)
    curve = overrides_from_namespace(ns, CurveSpec)
    methods = sorted(METHODS) if spec.get("method") == "all" else [spec.pop("method", CheckSpec.method)]
    spec.pop("method", None)
    params = _parse_params(ns.param)
    ok = True
    for m in methods:
        if curve.get("run"):  # whole `unison train` runs at 1 and W workers, loss curves compared
            report = run_curves_for_check(m, spec, curve, params)
        else:
            report = run_equivalence(m, method_params=params, **spec)
        print(report.summary(), flush=True)
        ok &= report.passed
    return 0 if ok else 1


def make_parser() -> argparse.ArgumentParser:
    from unison.check import CheckSpec, CurveSpec
    from unison.config import TrainConfig

    parser = argparse.ArgumentParser(prog="unison", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="self-supervised pre-training (default: SimCLR on digits, 2 workers)")
    p_train.add_argument("--config", metavar="FILE", help="YAML file of options (CLI flags override it)")
    p_train.add_argument("--param", action="append", metavar="NAME=VALUE", help="method hyper-parameter")
    add_dataclass_arguments(p_train, TrainConfig, skip=("method_params", "distributed"))
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
            if getattr(exc, "traceback", ""):
                print(exc.traceback, file=sys.stderr)
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
        print(f"unison: error: {where}{text}", file=sys.stderr)  # under torchrun every worker is a main()
        return code


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of a failure the user can act on (`unison.errors`); None for a bug."""
    from unison.distributed.launch import _is_comm_error
    from unison.errors import exit_code_of

    if "RANK" in os.environ and isinstance(exc, RuntimeError) and _is_comm_error(f"{type(exc).__name__} {exc}"):
        return 1  # under torchrun/srun: this worker lost a peer, whose own failure is the root cause
    return exit_code_of(exc)


if __name__ == "__main__":
    sys.exit(main())
