"""A run's options from the command line: flags, a ``--config`` YAML file and the resumed run's configuration.

Precedence: dataclass defaults < the resumed run's config < ``--config FILE.yaml`` < command-line flags. The
options are generated from `TrainConfig` and `DistributedConfig` (`unison.config.fields`), so there is no second
copy of the defaults. `parse_train_args` is what `unison bench` builds its runs with; the rest of the CLI
(`unison.cli`) dispatches the commands.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.config import DistributedConfig, TrainConfig
from unison.config.budget import parse_duration
from unison.config.fields import add_dataclass_arguments, overrides_from_namespace, shown
from unison.config.parser import Parser
from unison.errors import ConfigError


def parse_assignments(items: list[str] | None, flag: str, example: str) -> dict[str, Any]:
    """``NAME=VALUE`` items, each VALUE read as YAML (``0.2``, ``true``, ``[1, 2]``; never a Python object, no
    aliases, bounded numbers: `unison.config.files.StrictLoader`)."""
    values: dict[str, Any] = {}
    if not items:
        return values
    import yaml

    from unison.config.files import Sexagesimal, load_yaml_text, plain, sexagesimal_problem, yaml_error

    for item in items:
        if "=" not in item:
            raise ConfigError(f"{flag} {shown(item)} must look like NAME=VALUE, e.g. {flag} {example}")
        key, value = item.split("=", 1)
        try:
            parsed = load_yaml_text(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{flag} {key.strip()[:60]}={shown(value)} is not a value ({yaml_error(exc)}); give a "
                              f"number, true/false, a string or a [list], e.g. {flag} {example}") from None
        if isinstance(parsed, Sexagesimal):   # 1:30 is no number, nor silently the text for a number option
            name = f"{flag} {key.strip()[:60]}"
            raise ConfigError(f"{sexagesimal_problem(name, parsed, 'number', '=')}, or quote the text: "
                              f"{flag} '{key.strip()[:60]}=\"{parsed}\"'")
        values[key.strip()] = plain(parsed)
    return values


def parse_params(items: list[str] | None) -> dict[str, Any]:
    return parse_assignments(items, "--param", "temperature=0.2")


def load_yaml(path: str) -> dict[str, Any]:
    """The mapping of YAML file `path`: a regular file of at most 1 MiB, UTF-8, parsed strictly (no aliases,
    string keys given once: `unison.config.files`)."""
    import yaml

    from unison.config.files import decode_utf8, load_yaml_text, plain, read_regular_file, yaml_error
    from unison.config.problems import check_file

    if not path.strip():   # `--config "$CFG"` with CFG unset: not silently the defaults
        raise ConfigError("--config is empty; give a YAML file (or leave --config out for the defaults)")
    text = decode_utf8(read_regular_file(path, "config file"), f"config file {path}")
    try:
        data = load_yaml_text(text)
    except yaml.YAMLError as exc:
        where = yaml_error(exc)
        raise ConfigError(f"config file {path} is not valid YAML{' at ' if where.startswith('line ') else ': '}"
                          f"{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values "
                          "(see examples/configs/simclr_cifar10.yaml)")
    check_file(data, f"config file {path}")   # every problem of the file at once, one line each
    return plain(data)


def config_file(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` file's mapping: read once per command (kept on `ns`), a fresh copy for every caller."""
    if getattr(ns, "config_file_data", (None,))[0] != ns.config:
        ns.config_file_data = (ns.config, load_yaml(ns.config))
    return copy.deepcopy(ns.config_file_data[1])


def option_given(ns: argparse.Namespace, name: str) -> bool:
    """Whether option `name` is given: a flag, the ``--config`` file, or the run ``--resume`` continues."""
    return name in vars(ns) or bool(getattr(ns, "resume", None)) or bool(ns.config and name in config_file(ns))


def resume_base(resume: str) -> dict[str, Any]:
    from unison.training.checkpoint import read_header

    return dict(read_header(resume).config)   # the header only: the worker reads the weights, once


def build_train_config(ns: argparse.Namespace, cuda_available: bool | None = None, *,
                       validate: bool = True) -> TrainConfig:
    """The run's configuration from flags, ``--config`` and the resumed run, validated (`cuda_available`: as on a
    machine with or without CUDA; None: this machine; ``unison plan`` validates for the GPUs it simulates).
    `validate` False: as given, unchecked (``--resume auto`` reads ``--out`` from it before it knows whether the
    run resumes, which changes what is checked: a resumed run's teacher file need not exist)."""
    base: dict[str, Any] = {}
    named: dict[str, Any] = {}   # what this command itself gives (flags, --config), not the resumed run's
    resume = getattr(ns, "resume", None)
    if resume:
        base = resume_base(resume)
        base.pop("resume", None)
        if Path(resume).is_dir():
            base["out"] = str(resume)
    if ns.config is not None:
        file_cfg = config_file(ns)
        dist_file = file_cfg.pop("distributed", None) or {}
        base.update(file_cfg)
        named.update(file_cfg)
        base["distributed"] = {**base.get("distributed", {}), **dist_file}
    flags = overrides_from_namespace(ns, TrainConfig)
    named.update(flags)
    base.update(flags)
    dist_over = overrides_from_namespace(ns, DistributedConfig)
    base["distributed"] = {**base.get("distributed", {}), **dist_over}
    params = parse_params(ns.param)
    if params:
        base["method_params"] = {**base.get("method_params", {}), **params}
    backbone_args = parse_assignments(getattr(ns, "backbone_arg", None), "--backbone-arg", "drop_path_rate=0.1")
    if backbone_args:
        base["backbone_args"] = {**base.get("backbone_args", {}), **backbone_args}
    cfg = TrainConfig.from_dict(base, cuda_available)
    if cfg.time_budget is not None and "epochs" in named:   # the budget plans over it: say so, once
        parse_duration(cfg.time_budget)   # a budget that is not one is refused first, without the warning
        warnings.warn(f"--time-budget {cfg.time_budget} sets this run's length, so epochs={named['epochs']} is not "
                      "used: the run trains the steps that fit its time (--max-steps caps them)", stacklevel=2)
    if resume:
        cfg.resume = resume
    if not validate:
        return cfg
    cfg.validate(cuda_available)   # the fields first, without torch: a mistyped value is refused in a fraction of a second
    from unison.training.resolve import validate_run  # the registries below import torch: not for --help

    return validate_run(cfg, cuda_available)


def parse_train_args(argv: list[str], what: str = "unison train", *, validate: bool = True) -> TrainConfig:
    """The `TrainConfig` that ``unison train ARGV`` would run (flags, ``--config``, ``--param``, ``--resume``); a
    usage error is a `ConfigError` naming `what` gave the flags. `validate` False: the fields' own checks only
    (`TrainConfig.validate`, no torch, no data read)."""
    parser = Parser(prog="unison train")
    parser.error_prefix = f"{what}: "
    add_train_arguments(parser)
    ns = parser.parse_args(argv)
    if validate:
        return build_train_config(ns)
    return build_train_config(ns, cuda_available=True, validate=False).validate(cuda_available=True)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``unison train``: generated from `TrainConfig` and `DistributedConfig`, plus the three
    that are not fields (``--config``, ``--param``, ``--backbone-arg``)."""
    parser.add_argument("--config", metavar="FILE",
                         help="YAML file of options (CLI flags override it); see examples/configs/simclr_cifar10.yaml")
    parser.add_argument("--param", action="append", metavar="NAME=VALUE",
                         help="method hyper-parameter, repeatable (names and defaults below)")
    parser.add_argument("--backbone-arg", action="append", metavar="NAME=VALUE",
                         help="setting of a timm backbone, repeatable, e.g. --backbone-arg drop_path_rate=0.1 "
                              "(img_size follows --image-size when the model takes it)")
    add_dataclass_arguments(parser, TrainConfig, skip=("method_params", "distributed", "backbone_args"))
    add_dataclass_arguments(parser, DistributedConfig, group_title="distributed", skip=("rank",))
    parser.add_argument("--shard-optimizer", dest="shard", action="store_const", const="optimizer",
                         default=argparse.SUPPRESS, help="alias of --shard optimizer (ZeRO-1)")



class LazyEpilogParser(Parser):
    """A `unison.config.parser.Parser` whose epilog may come from a function, called only when the help is shown: the
    train epilog lists the registries, which import torch, and a typo's one-line error does not wait for that. Its
    sub-commands' parsers are of this class too (argparse makes them of the parent's)."""

    lazy_epilog: Callable[[], str] | None = None

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog, self.lazy_epilog = self.lazy_epilog(), None
        return super().format_help()


def epilog_lists() -> tuple[list[tuple[str, list[tuple[str, Any]]]], list[str], list[str]]:
    """What `unison train --help` ends with: each method with its hyper-parameters and their defaults, the
    augmentation presets and the backbones (the documentation's command-line reference shows the same)."""
    from unison.data.augment import PRESETS
    from unison.methods import METHODS
    from unison.models.backbones import BACKBONES

    methods = []
    for name in sorted(METHODS):
        defaults = METHODS[name].Params()
        methods.append((name, [(f.name, getattr(defaults, f.name)) for f in dataclasses.fields(defaults)]))
    return methods, sorted(PRESETS), list(BACKBONES)


def train_epilog(width: int = 100) -> str:
    """The lists `unison train --help` ends with: methods and their --param names, presets, backbones."""
    import textwrap

    methods, presets, backbones = epilog_lists()
    lines = ["methods (--method) and their hyper-parameters (--param NAME=VALUE; defaults shown):"]
    for name, params in methods:
        text = " ".join(f"{key}={value}" for key, value in params)
        lines += textwrap.wrap(text, width, initial_indent=f"  {name:<12} ", subsequent_indent=" " * 15)
    lines.append("")
    lines += textwrap.wrap(f"augmentation presets (--augmentation): {', '.join(presets)}; default: the "
                           "method's recipe (a run's config.json records the one it used, under 'resolved')",
                           width)
    lines += textwrap.wrap(f"backbones (--backbone): {', '.join(backbones)}, timm:<model> (settings with "
                           "--backbone-arg NAME=VALUE)", width)
    lines += textwrap.wrap("A YAML file (--config) takes the same options by their field names (batch_size: 256), "
                           "the distributed ones under 'distributed:', method hyper-parameters under "
                           "'method_params:'; see examples/configs/simclr_cifar10.yaml.", width)
    return "\n".join(lines)
