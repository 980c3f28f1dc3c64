"""`unison bench PART`: benchmarks of unison on this machine, and against Lightly SSL and torchvision.

Options are generated from `BenchConfig` (``--preset cpu|gpu|gpu1`` picks the preset, every
other flag overrides one field of it); each part offers the options it reads
(`PART_OPTIONS`, ``unison bench lightly --help``), ``all`` every option. Each part prints its table and writes markdown and
CSV (the table also a PNG) into ``--out`` (default ``runs/bench/<preset>``); ``all`` runs
the four parts and also writes ``report.md``, the sections one after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from unison.config.extras import install_command
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
from .report import result_paths

_WHAT = {
    "table": ("Distributed table",
              "Lightly's distributed-table layout, each configuration one real `unison train` run: 1 worker; W workers "
              "with SyncBN + gather (exact); W workers with gather only."),
    "comm": ("Communication per step",
             "Bytes each worker hands to collectives per step, counted at every collective call, against the ideal "
             "(the gradient in bytes); W real gloo/NCCL workers, random images."),
    "lightly": ("Side by side with Lightly SSL",
                "Each --method (seed: Lightly's six; all: also vicreg, dino, mae, nnclr, dcl, dclw, tico, fastsiam, mmcr, "
                "wmse, smog, empssl, vicregl, densecl, msn, pmsn, simmim, aim, capi) with "
                "the same backbone type, data, global batch, steps and schedule, each side its own recipe (Lightly's: "
                "its modules, transforms and CIFAR-10 settings); one training process per side (Lightly's with its "
                "DataLoader workers); kNN of both encoders by the same code, throughput and peak memory."),
    "data": ("Data loading at 224 px",
             "Images/s and images per CPU-second of SimCLR's two 224 px views from a JPEG folder: unison's "
             "streaming loader against the decode limit (libjpeg-turbo), torchvision's ImageFolder + Lightly's "
             "SimCLRTransform and DALI's CPU pipeline, the same number of loader processes."),
    "race": ("Race against Lightly SSL at equal wall-clock time",
             "SimCLR, same backbone type, images and global batch: unison (`--preset speedrun --time-budget`) and "
             "Lightly's documented pipeline with its CIFAR-10 hyper-parameters, one after the other, the same budget "
             "each (setup included); every snapshot scored by the same kNN code on the val images afterwards."),
    "scaling": ("Scaling on this machine",
                "The same global batch and number of steps on 1 worker and on W workers, one thread each; "
                "throughput ratio in images/s of the training loop."),
}


# The options each part reads (the others keep the preset's value); `all` takes every option.
_COMMON = ("preset", "backbone", "seed", "out", "max_load", "load_wait_s", "dry_run", "overwrite")
_DATA = ("data", "val", "subset", "val_subset", "knn_k")
PART_OPTIONS = {
    "table": (*_COMMON, *_DATA, "methods", "epochs", "batch_size", "workers", "threads", "backend", "train_args"),
    "comm": (*_COMMON, "methods", "batch_size", "workers", "backend", "comm_steps"),
    "lightly": (*_COMMON, *_DATA, "method", "seeds", "epochs", "batch_size", "backend", "train_args", "lightly_steps",
                "lightly_loader_workers", "lightly_threads", "peak_tflops"),
    "scaling": (*_COMMON, *_DATA, "methods", "epochs", "batch_size", "workers", "threads", "backend", "train_args",
                "scaling_steps"),
    "race": (*_COMMON, "data", "val", "race_subset", "race_val_subset", "knn_k", "batch_size", "budget", "race_points",
             "lightly_loader_workers", "lightly_threads", "train_args"),
    "data": (*_COMMON, "data_folder", "data_images", "data_batch_size", "data_batches", "data_loader_workers",
             "data_repeats", "data_threads"),
}
LIGHTLY_EXTRA = install_command("bench")


def add_subcommand(subparsers: Any, help_text: str) -> None:
    import dataclasses

    p = subparsers.add_parser("bench", help=help_text,
                              description="Benchmarks of unison on this machine, and against Lightly SSL and "
                                          "torchvision. Each part has its own options: unison bench PART --help.")
    parts = p.add_subparsers(dest="part", required=True, metavar="PART")
    all_fields = tuple(f.name for f in dataclasses.fields(BenchConfig))
    for part in PARTS:
        title, what = _WHAT.get(part, ("All parts", "table, comm, lightly and scaling, one after another, and a "
                                                     "report.md of their sections."))
        if part in ("lightly", "race", "all"):
            what += (f" The Lightly side needs Lightly SSL ({LIGHTLY_EXTRA}); without it `bench lightly` stops "
                     "with that hint and `bench all` reports the side as not measured.")
        sp = parts.add_parser(part, help=title.lower(), description=f"{title}: {what}")
        options = PART_OPTIONS.get(part, all_fields)
        add_dataclass_arguments(sp, BenchConfig, skip=tuple(f for f in all_fields if f not in options))
        sp.set_defaults(func=cmd_bench)


def cmd_bench(ns: argparse.Namespace) -> int:
    cfg = config_from_overrides(overrides_from_namespace(ns, BenchConfig))
    parts = [p for p in PARTS if p not in NOT_IN_ALL] if ns.part == "all" else [ns.part]
    check_train_args(cfg, parts)   # as `unison train` reads them, before any work (the dry run too)
    if cfg.dry_run:
        _print_plan(cfg, parts)
        return 0
    check_devices(cfg, parts)
    _check_lightly(parts)
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


def _check_lightly(parts: list[str]) -> None:
    """`bench lightly` without Lightly SSL installed stops with the install hint; `bench all` says so up front."""
    from .lightly_compare import lightly_available

    if "race" in parts:
        parts = ["lightly"]   # the race needs the Lightly side: stop with the hint
    if "lightly" not in parts:
        return
    why_not = lightly_available()
    if why_not is None:
        return
    if parts == ["lightly"]:
        raise ConfigError(f"bench lightly needs Lightly SSL, which does not import ({why_not})")
    print(f"unison bench: warning: Lightly SSL does not import ({why_not}); the Lightly side will be reported "
          "as not measured", file=sys.stderr, flush=True)


def check_devices(cfg: BenchConfig, parts: list[str]) -> None:
    import torch

    if cfg.backend != "nccl":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = 1 if set(parts) <= {"lightly", "race"} else cfg.workers   # the Lightly comparison trains on one GPU
    if n < needed:
        raise ConfigError(f"bench: the {cfg.preset} preset runs {cfg.workers} NCCL workers, one per GPU, but "
                          f"{n} GPU(s) are visible; use --workers {max(n, 2)} on a multi-GPU machine, --dry-run to "
                          "see the commands, or --preset cpu")


def _header(part: str, cfg: BenchConfig, machine: str, load_note: str) -> str:
    from .report import section_header

    title, what = _WHAT[part]
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
        return f"## {_WHAT[part][0]}\n\nSkipped: {data}\n"
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
    if part == "race":
        from .race import race, write_race

        result = race(cfg, train, val, out)
        return write_race(result, out, _header(part, cfg, machine, "before each side and after: the Load "
                                                "column"))["md"].read_text()
    if part == "lightly":
        from .lightly_compare import compare, write_lightly

        rows = compare(cfg, train, val, out)
        return write_lightly(rows, out, _header(part, cfg, machine, per_row))["md"].read_text()
    raise ValueError(part)


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
    from .lightly_compare import for_method, side_run_name, side_threads, unison_side_argv
    from .race import unison_argv
    from .table import scaling_specs, table_specs, train_argv

    if part in ("table", "scaling"):
        specs = table_specs(cfg) if part == "table" else scaling_specs(cfg)
        return [train_argv(cfg, spec, train, val, out / "runs" / spec.name) for spec in specs]
    if part == "lightly":
        seeded = [(m, dataclasses.replace(cfg, seed=seed)) for m in cfg.lightly_method_list for seed in cfg.seed_list]
        return [unison_side_argv(for_method(c, m), m, train, val, out / "runs" / side_run_name(c, m)) for m, c in seeded]
    if part == "race":
        return [unison_argv(cfg, train, out / "runs" / "race-unison", side_threads(cfg))]
    return []


def check_train_args(cfg: BenchConfig, parts: list[str]) -> None:
    """``--train-args`` read as ``unison train`` reads them (flags, values, each run's options together), for
    every part that takes them: one line before any work, the dry run included (the data need not exist yet)."""
    from unison.cli.train_args import parse_train_args

    if not cfg.train_args.strip():
        return
    data = data_or_skip(cfg)
    train, val = data if isinstance(data, tuple) else (cfg.data, cfg.val)
    for part in parts:
        if "train_args" not in PART_OPTIONS.get(part, ()):
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
    paths = [p for part in [*parts, *(["all"] if command == "all" else [])] for p in result_paths(out, part).values()]
    paths += [Path(argv[argv.index("--out") + 1]) for part in parts for argv in _train_argvs(cfg, part, train, val, out)]
    there = [p for p in paths if p.exists() or p.is_symlink()]
    if there:
        named = ", ".join(str(p.relative_to(out)) + ("/" if p.is_dir() else "") for p in there[:6])
        more = f" and {len(there) - 6} more" if len(there) > 6 else ""
        raise ConfigError(f"bench {command}: --out {out} already holds {named}{more} (an earlier bench's results "
                          "and runs); they are left as they are: pass --overwrite to replace them, or choose another "
                          "--out")


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
        elif part == "lightly":
            for argv, method in zip(argvs, (m for m in cfg.lightly_method_list for _ in cfg.seed_list)):
                print("unison " + shlex.join(argv))
                print(f"# + Lightly SSL side of {method}: its transform, heads and loss + DataLoader("
                      f"{cfg.lightly_loader_workers} workers), {cfg.lightly_steps} steps of {cfg.batch_size}")
        elif part == "race":
            print("unison " + shlex.join(argvs[0]))
            print(f"# + Lightly SSL side: SimCLRTransform + DataLoader({cfg.lightly_loader_workers} workers), "
                  f"budget {cfg.budget}; then kNN of {cfg.race_points} + 1 snapshots per side")
        elif part == "data":
            print(f"# data: {cfg.data_batches} batches of {cfg.data_batch_size} at 224 px, "
                  f"{cfg.data_loader_workers} loader workers per side, {cfg.data_folder or 'generated JPEGs'}")
        elif part == "comm":
            for s in default_specs(cfg.method_list):
                print(f"# comm: {s.method}, {s.label}, compression {s.compression}: {cfg.workers} workers, "
                      f"{cfg.comm_steps} steps, {cfg.backbone}, global batch {cfg.batch_size}")
