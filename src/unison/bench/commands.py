"""`unison bench PART`: benchmarks of unison on this machine, and against Lightly SSL and torchvision.

Options are generated from `BenchConfig` (``--preset cpu|gpu|gpu1`` picks the preset, every
other flag overrides one field of it); each part offers the options it reads
(`PART_OPTIONS`, ``unison bench comm --help``), ``all`` every option. Each part prints its table and writes markdown and
CSV (the table also a PNG) into ``--out`` (default ``runs/bench/<preset>``); ``all`` runs
the parts but the race and also writes ``report.md``, the sections one after another.

``lightly`` and ``race``, the peer comparisons, are the lab's (``benchmarks/lab`` of a clone, `unison.bench.lab`):
this module declares them with the lab's options (`LabConfig`) and hands them to it; where there is no lab they
refuse in one line, and ``all`` leaves the Lightly comparison out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from unison.config.fields import add_dataclass_arguments, overrides_from_namespace, shown
from unison.distributed.signals import stop_signals_raise
from unison.errors import BenchError, ConfigError, Preempted, WorkerFailure

from .config import (
    NOT_IN_ALL,
    PARTS,
    BenchConfig,
    bench_command,
    config_from_overrides,
    data_or_skip,
    describe_machine,
    format_load,
    loadavg,
    machine_info,
)
from .lab import TITLES, find_lab, not_here
from .report import result_paths

_WHAT = {
    "table": ("Distributed table",
              "Lightly's distributed-table layout, each configuration one real `unison train` run: 1 worker; W workers "
              "with SyncBN + gather (exact); W workers with gather only."),
    "comm": ("Communication per step",
             "Bytes each worker hands to collectives per step, counted at every collective call, against the ideal "
             "(the gradient in bytes); W real gloo/NCCL workers, random images."),
    "data": ("Data loading at 224 px",
             "Images/s and images per CPU-second of SimCLR's two 224 px views from a JPEG folder: unison's "
             "streaming loader against the decode limit (libjpeg-turbo), torchvision's ImageFolder + Lightly's "
             "SimCLRTransform and DALI's CPU pipeline, the same number of loader processes."),
    "scaling": ("Scaling on this machine",
                "The same global batch and number of steps on 1 worker and on W workers, one thread each; "
                "throughput ratio in images/s of the training loop."),
}


# The options each part reads (the others keep the preset's value); `all` takes every option.
COMMON_OPTIONS = ("preset", "backbone", "seed", "out", "max_load", "load_wait_s", "dry_run", "overwrite")
DATA_OPTIONS = ("data", "val", "subset", "val_subset", "knn_k")
PART_OPTIONS = {   # and the lab's parts (`part_options`)
    "table": (*COMMON_OPTIONS, *DATA_OPTIONS, "methods", "epochs", "batch_size", "workers", "threads", "backend",
              "train_args"),
    "comm": (*COMMON_OPTIONS, "methods", "batch_size", "workers", "backend", "comm_steps"),
    "scaling": (*COMMON_OPTIONS, *DATA_OPTIONS, "methods", "epochs", "batch_size", "workers", "threads", "backend",
                "train_args", "scaling_steps"),
    "data": (*COMMON_OPTIONS, "data_folder", "data_images", "data_batch_size", "data_batches", "data_loader_workers",
             "data_repeats", "data_threads"),
}


def part_options(lab: ModuleType | None) -> dict[str, tuple[str, ...]]:
    """The options each part reads: `PART_OPTIONS` and, with the lab, its parts'."""
    return {**PART_OPTIONS, **(lab.parts.OPTIONS if lab is not None else {})}


def config_class(lab: ModuleType | None) -> type[BenchConfig]:
    """The options of ``bench all`` and the lab's parts: every field of `LabConfig` with the lab, else `BenchConfig`."""
    return lab.LabConfig if lab is not None else BenchConfig


def _what(part: str, lab: ModuleType | None) -> tuple[str, str]:
    if part in TITLES:
        return TITLES[part], lab.parts.WHAT[part] if lab is not None else not_here(part)
    return _WHAT.get(part, ("All parts", "table, comm, lightly and scaling, one after another, and a report.md of "
                                         "their sections."))


def add_subcommand(subparsers: Any, help_text: str) -> None:
    p = subparsers.add_parser("bench", help=help_text,
                              description="Benchmarks of unison on this machine, and against Lightly SSL and "
                                          "torchvision. Each part has its own options: unison bench PART --help.")
    parts = p.add_subparsers(dest="part", required=True, metavar="PART")
    lab = find_lab()
    options_of = part_options(lab)
    for part in PARTS:
        title, what = _what(part, lab)
        if part in TITLES and lab is None:   # whatever its words (--help too), the one line of `not_here`
            sp = parts.add_parser(part, help=title.lower(), description=what, prefix_chars="+", add_help=False)
            sp.add_argument("words", nargs="*", help=argparse.SUPPRESS)
            sp.set_defaults(func=_not_here)
            continue
        if part in (*TITLES, "all"):
            what += lab.parts.NEEDS_LIGHTLY if lab is not None else (
                " The Lightly comparison runs from a clone of the repository (its benchmarks/lab): without it "
                "`bench all` leaves it out.")
        sp = parts.add_parser(part, help=title.lower(), description=f"{title}: {what}")
        cls = config_class(lab) if part in (*TITLES, "all") else BenchConfig
        all_fields = tuple(f.name for f in dataclasses.fields(cls))
        options = options_of.get(part, all_fields)
        add_dataclass_arguments(sp, cls, skip=tuple(f for f in all_fields if f not in options))
        sp.set_defaults(func=cmd_bench)


def _not_here(ns: argparse.Namespace) -> int:
    raise ConfigError(not_here(ns.part))


def cmd_bench(ns: argparse.Namespace) -> int:
    lab = find_lab() if ns.part in (*TITLES, "all") else None   # a lab part without the lab is `_not_here`'s
    overrides = overrides_from_namespace(ns, config_class(lab))
    cfg = lab.config.config_from_overrides(overrides) if lab is not None else config_from_overrides(overrides)
    if ns.part != "all":
        parts = [ns.part]
    else:   # every part but the race; without the lab, without the Lightly comparison (said here, once)
        parts = [p for p in PARTS if p not in NOT_IN_ALL and (lab is not None or p not in TITLES)]
        if lab is None:
            print(f"unison bench: warning: {not_here('all')}", file=sys.stderr, flush=True)
    check_train_args(cfg, parts)   # as `unison train` reads them, before any work (the dry run too)
    if cfg.dry_run:
        _print_plan(cfg, parts)
        return 0
    check_devices(cfg, parts)
    if lab is not None and set(parts) & set(TITLES):
        lab.parts.check(parts)   # Lightly SSL imports, or the hint to install it
    check_outputs(cfg, parts, ns.part)   # nothing an earlier bench left is replaced without --overwrite
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(machine_info())
    sections = []
    running = [parts[0]]
    with stop_signals_raise(lambda name: Preempted(_stopped(running[0], name), signal_name=name)):   # one line, 75
        for part in parts:
            running[0] = part
            started = time.perf_counter()
            try:
                text = _run_part(part, cfg, out, machine)
            except (BenchError, WorkerFailure) as exc:
                print(f"unison: error: bench {part}: {exc}", file=sys.stderr)
                return 1
            except Preempted as exc:   # forwarded to a training run's workers, which stopped after a step
                name = exc.signal_name or "a stop signal"
                raise Preempted(_stopped(part, name), signal_name=exc.signal_name) from None
            print(text, flush=True)
            print(f"unison bench: {part} took {time.perf_counter() - started:.0f} s; files in {out}", flush=True)
            sections.append(text)
    if ns.part == "all":
        result_paths(out, "all")["md"].write_text(f"# unison bench ({cfg.preset})\n\n" + "\n".join(sections))
    return 0


def _stopped(part: str, signal_name: str) -> str:
    return (f"bench {part} stopped by {signal_name}: a stopped part reports nothing (parts finished before it kept "
            "their files); run the same command again")


def check_devices(cfg: BenchConfig, parts: list[str]) -> None:
    import torch

    if cfg.backend != "nccl":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = 1 if set(parts) <= set(TITLES) else cfg.workers   # the lab's comparisons train on one GPU
    if n < needed:
        raise ConfigError(f"bench: the {cfg.preset} preset runs {cfg.workers} NCCL workers, one per GPU, but "
                          f"{n} GPU(s) are visible; use --workers {max(n, 2)} on a multi-GPU machine, --dry-run to "
                          "see the commands, or --preset cpu")


def _header(part: str, cfg: BenchConfig, machine: str, load_note: str) -> str:
    from .report import section_header

    title, what = _what(part, find_lab() if part in TITLES else None)
    return section_header(title, what, bench_command(part, cfg), machine, load_note)


def _run_part(part: str, cfg: BenchConfig, out: Path, machine: str) -> str:
    start_load = format_load(loadavg())
    if part == "comm":
        return _run_comm(cfg, out, machine, start_load)
    if part == "data":
        from .data_loader import measure as measure_data
        from .data_loader import write as write_data

        rows = measure_data(cfg, out)
        return write_data(rows, out, _header(part, cfg, machine, f"at start {start_load}; before each run: "
                                             "the last column"))["md"].read_text()
    data = data_or_skip(cfg)
    if isinstance(data, str):
        msg = f"unison bench: {part} skipped: {data}"
        print(msg, flush=True)
        return f"## {_what(part, None)[0]}\n\nSkipped: {data}\n"
    train, val = data
    per_row = f"at start {start_load}; just before each run: the Load column"
    if part == "table":
        from .table import add_speedups, baseline_memory_mib, measure, table_specs, write_table

        rows = add_speedups(measure(cfg, table_specs(cfg), train, val, out))
        header = _header(part, cfg, machine, per_row)
        paths = write_table(rows, out, header, title=f"unison bench --preset {cfg.preset} ({cfg.backbone}, "
                                                     f"global batch {cfg.batch_size})",
                            baseline_mib=baseline_memory_mib())
        return paths["md"].read_text()
    if part == "scaling":
        from .table import measure, scaling_specs, write_scaling

        rows = measure(cfg, scaling_specs(cfg), train, val, out)
        return write_scaling(rows, out, _header(part, cfg, machine, per_row))["md"].read_text()
    lab = find_lab() if part in TITLES else None
    if lab is None:
        raise ValueError(part)
    return lab.parts.run(part, cfg, train, val, out, lambda note: _header(part, cfg, machine, note), start_load)


def _run_comm(cfg: BenchConfig, out: Path, machine: str, start_load: str) -> str:
    import torch

    from .comm import default_specs, run_comm_report, write_comm
    from .config import wait_for_load

    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    load = format_load(wait_for_load(cfg.max_load, cfg.load_wait_s))
    print(f"unison bench: communication report, {cfg.workers} {backend} workers (load {load}) ...", flush=True)
    rows = run_comm_report(default_specs(cfg.method_list), backbone=cfg.backbone, global_batch=cfg.batch_size,
                           workers=cfg.workers, steps=cfg.comm_steps, backend=backend)
    return write_comm(rows, out, _header("comm", cfg, machine, load))["md"].read_text()


def _train_argvs(cfg: BenchConfig, part: str, train: str, val: str | None, out: Path) -> list[list[str]]:
    """The ``unison train`` arguments of every run of `part` (none for the parts that run no training)."""
    from .table import scaling_specs, table_specs, train_argv

    if part in ("table", "scaling"):
        specs = table_specs(cfg) if part == "table" else scaling_specs(cfg)
        return [train_argv(cfg, spec, train, val, out / "runs" / spec.name) for spec in specs]
    lab = find_lab() if part in TITLES else None
    if lab is not None:
        return lab.parts.train_argvs(part, cfg, train, val, out)
    return []


def check_train_args(cfg: BenchConfig, parts: list[str]) -> None:
    """``--train-args`` read as ``unison train`` reads them (flags, values, each run's options together), for
    every part that takes them: one line before any work, the dry run included (the data need not exist yet)."""
    from unison.cli.train_args import parse_train_args

    if not cfg.train_args.strip():
        return
    data = data_or_skip(cfg)
    train, val = data if isinstance(data, tuple) else (cfg.data, cfg.val)
    options_of = part_options(find_lab() if set(parts) & set(TITLES) else None)
    for part in parts:
        if "train_args" not in options_of.get(part, ()):
            continue
        what = f"bench {part}: --train-args {shown(cfg.train_args)}"
        for argv in _train_argvs(cfg, part, train, val, cfg.out_dir)[:1]:   # the others differ in the bench's own
            try:
                with warnings.catch_warnings():   # the run itself says them, once
                    warnings.simplefilter("ignore")
                    parse_train_args(argv[1:], what, validate=False)
            except ConfigError as exc:   # a usage error names `what` already; a value's error does not
                raise ConfigError(str(exc) if str(exc).startswith(what) else f"{what}: {exc}") from None


def check_outputs(cfg: BenchConfig, parts: list[str], command: str) -> None:
    """The result files (`result_paths`) and run directories the bench would write in ``--out``: refused in one line
    where any exists and ``--overwrite`` is not given (every command's rule, `unison.paths`), before any work."""
    if cfg.overwrite:
        return
    out = cfg.out_dir
    data = data_or_skip(cfg)
    train, val = data if isinstance(data, tuple) else (cfg.data, cfg.val)
    paths = [p for part in [*parts, *(["all"] if command == "all" else [])] for p in _result_paths(out, part).values()]
    paths += [Path(argv[argv.index("--out") + 1]) for part in parts for argv in _train_argvs(cfg, part, train, val, out)]
    there = [p for p in paths if p.exists() or p.is_symlink()]
    if there:
        named = ", ".join(str(p.relative_to(out)) + ("/" if p.is_dir() else "") for p in there[:6])
        more = f" and {len(there) - 6} more" if len(there) > 6 else ""
        raise ConfigError(f"bench {command}: --out {out} already holds {named}{more} (an earlier bench's results "
                          "and runs); they are left as they are: pass --overwrite to replace them, or choose another "
                          "--out")


def _result_paths(out: Path, part: str) -> dict[str, Path]:
    lab = find_lab() if part in TITLES else None
    return lab.parts.result_paths(out, part) if lab is not None else result_paths(out, part)


def _print_plan(cfg: BenchConfig, parts: list[str]) -> None:
    import shlex

    from .comm import default_specs

    data = data_or_skip(cfg)
    train, val = data if isinstance(data, tuple) else (cfg.data, cfg.val)
    out = cfg.out_dir
    if isinstance(data, str):
        print(f"# note: {data}")
    for part in parts:
        print(f"# {part}")
        argvs = _train_argvs(cfg, part, train, val, out)
        if part in ("table", "scaling"):
            for argv in argvs:
                print("unison " + shlex.join(argv))
        elif part in TITLES:
            lab = find_lab()
            if lab is not None:
                lab.parts.print_plan(part, cfg, argvs)
        elif part == "data":
            print(f"# data: {cfg.data_batches} batches of {cfg.data_batch_size} at 224 px, "
                  f"{cfg.data_loader_workers} loader workers per side, {cfg.data_folder or 'generated JPEGs'}")
        elif part == "comm":
            for s in default_specs(cfg.method_list):
                print(f"# comm: {s.method}, {s.label}, compression {s.compression}: {cfg.workers} workers, "
                      f"{cfg.comm_steps} steps, {cfg.backbone}, global batch {cfg.batch_size}")
