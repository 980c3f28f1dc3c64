"""The `unison` command: train, check, eval, export.

Options are generated from the configuration dataclasses (`TrainConfig`,
`DistributedConfig`, `CheckSpec`), so ``--help`` shows every option with its default and
there is no second copy of the defaults. Precedence: dataclass defaults < ``--config
FILE.yaml`` (or the resumed run's config) < command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from unison.configutil import add_dataclass_arguments, overrides_from_namespace
from unison.distributed.config import ConfigError, DistributedConfig


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


def build_train_config(ns: argparse.Namespace) -> "TrainConfig":  # noqa: F821
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


def cmd_train(ns: argparse.Namespace) -> int:
    from unison.distributed.env import detect_launch_env
    from unison.distributed.launch import WorkerFailure, launch
    from unison.train.loop import train_worker

    cfg = build_train_config(ns)
    started = time.perf_counter()
    if detect_launch_env() is not None:          # torchrun / srun / mpirun started this process
        train_worker(cfg.to_dict())
        return 0
    if cfg.distributed.world_size == 1:
        train_worker(cfg.to_dict())
    else:
        try:
            launch(train_worker, cfg.to_dict(), cfg.distributed, threads_per_worker=cfg.threads)
        except WorkerFailure as exc:
            print(f"unison: error: {exc}", file=sys.stderr)
            return 1
    summary_path = Path(cfg.out) / "summary.json"
    summary = json.loads(summary_path.read_text())
    wall = time.perf_counter() - started
    print(f"{summary['method']} x{summary['world_size']} workers, {summary['steps']} steps, "
          f"{wall:.0f} s: kNN top-1 {summary['knn_top1']:.4f} vs random init {summary['random_init_knn_top1']:.4f} "
          f"(run dir {cfg.out})")
    return 0


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
    try:
        return ns.func(ns)
    except ConfigError as exc:
        print(f"unison: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("unison: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
