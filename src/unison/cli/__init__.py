"""The `unison` command: train, check, plan, eval, embed, export, plot, bench.

Options are generated from the configuration dataclasses (`TrainConfig`, `DistributedConfig`, `CheckSpec`), so
``--help`` shows every option with its default and there is no second copy of the defaults. How a run's options
are read (flags, ``--config FILE.yaml``, the resumed run's config) is `unison.cli.train_args`; ``eval``, ``embed``,
``export``, ``plot`` and ``bench`` add their own subcommands (`SUBCOMMANDS`: only the one run is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, cast

from unison.config.fields import add_dataclass_arguments, overrides_from_namespace
from unison.errors import (
    BROKEN_PIPE_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    ConfigError,
    ConfigProblems,
    OutputError,
    Preempted,
    RunDirRefused,
    UnisonError,
    WatchdogTimeout,
    error_prefix,
    exit_code_of,
    one_line_warnings,
)
from unison.training.metrics import append_run_log

from .help_texts import CHECK, DESCRIPTION, EPILOG, PLAN, TRAIN
from .train_args import (
    LazyEpilogParser,
    add_train_arguments,
    build_train_config,
    config_file,
    option_given,
    parse_params,
    train_epilog,
)

if TYPE_CHECKING:   # annotations only: the commands import what they run when called (fast --help)
    from unison.equivalence import CheckReport, CurvesReport

WORKER_COMMANDS = ("train", "check", "embed", "bench")   # the commands that start worker processes

# Further subcommands live beside their concern, each module's add_subcommand(subparsers, help) declaring its
# options. Only the one being run is imported: eval, embed and export import torch, and `unison --help` must not.
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (   # (name, module, one-line help)
    ("eval", "unison.evaluation", "kNN, linear probes and fine-tuning of a checkpoint, against from scratch"),
    ("embed", "unison.embedding", "backbone features of a folder, list or shards, in input order (.npy + names)"),
    ("export", "unison.export", "write the trained backbone as a plain state dict (.pt or safetensors)"),
    ("plot", "unison.plotting", "overlay the metrics of several runs on one page (a .png)"),
    ("bench", "unison.bench.commands", "benchmarks: distributed table, communication, Lightly, scaling, data"),
)


def cmd_train(ns: argparse.Namespace) -> int:
    # no torch until the options are checked: a mistyped one is refused at once
    from unison.distributed.launch_env import detect_launch_env

    if getattr(ns, "config", None):  # every problem of the file at once, before anything else reads it
        config_file(ns)
    if getattr(ns, "resume", None) == "auto":  # --resume auto: continue the run in --out if it has a checkpoint
        from unison.training.checkpoint import latest_checkpoint

        ns.resume = None
        out = build_train_config(ns, validate=False).out   # unchecked here: the build below checks every value
        try:
            ns.resume = out if latest_checkpoint(out) is not None else None
        except (OSError, ValueError):   # a bad --out holds no checkpoint; the build below says what is wrong
            ns.resume = None
    launch_env = detect_launch_env()
    if launch_env is not None:   # before anything slow: every rank refuses it at once
        _check_world_size(ns, launch_env)
    # the fields here, without torch, so a mistyped value is refused at once; `unison.train` resolves the rest once
    cfg = build_train_config(ns, validate=False).validate()
    from unison.api import train
    from unison.training.checkpoint import latest_checkpoint

    if cfg.resume == "auto":  # `resume: auto` in a YAML file: the file's options stand, weights come from --out
        cfg.resume = cfg.out if latest_checkpoint(cfg.out) is not None else None
    started = time.perf_counter()
    try:
        with _stop_before_training(cfg.out):   # a stop signal leaves it as `Preempted`, logged below
            summary = train(cfg)   # a WorkerFailure goes to main(), which prints it as one line
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_where_to_continue(cfg.out)) from None
    except WatchdogTimeout as exc:
        if launch_env is None or launch_env.rank == 0:
            append_run_log(cfg.out, f"unison: error: {' '.join(str(exc).split())}")
        raise WatchdogTimeout(f"{exc}; {_where_to_continue(cfg.out)}") from None
    except RunDirRefused:
        raise   # not this run's directory (another run's, the data): not even a line of its train.log
    except UnisonError as exc:
        if launch_env is None or launch_env.rank == 0:
            append_run_log(cfg.out, f"unison: {error_prefix(exc)}{' '.join(str(exc).split())}")
        raise
    if launch_env is None or launch_env.rank == 0:   # under torchrun/srun/mpirun: rank 0 prints the result
        line = summary.result_line(time.perf_counter() - started)
        append_run_log(cfg.out, line)   # first: the run log has it even when standard output cannot be written
        print(line, flush=True)
    return 0


def _where_to_continue(out: str) -> str:
    """Where the last complete checkpoint of run directory `out` is, and how to continue from it."""
    from unison.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(out)
    return (f"no checkpoint was written in {out}" if last is None
            else f"the last checkpoint is {last}; continue with --resume auto --out {out}")


def _stop_before_training(out: str | None = None) -> contextlib.AbstractContextManager[None]:
    """SIGTERM/SIGUSR1 before the workers run (pre-flight, data scan): end at once with a line, nothing to save.
    Training (launcher or loop) replaces this handler and puts it back as it ends, also as it fails (torchrun
    SIGTERMs a dead worker's peers at once): a stop then names `out`'s last checkpoint (`stop_handovers` tells)."""
    from unison.distributed.signals import stop_handovers, stop_signals_raise

    began = stop_handovers()
    return stop_signals_raise(lambda name: Preempted(
        f"stopped by {name} before training started: nothing to save; run the same command again"
        if stop_handovers() == began else f"stopped by {name} after its training had stopped: "
        f"{_where_to_continue(out) if out else 'continue with --resume auto and the same --out'}", signal_name=name))


def _explicit_world_size(ns: argparse.Namespace) -> int | None:
    """The world size the user asked for on the command line or in the config file (None: not asked)."""
    if getattr(ns, "world_size", None) is not None:
        return ns.world_size
    if getattr(ns, "config", None):
        dist = config_file(ns).get("distributed") or {}
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
    from unison.equivalence import CheckSpec, CurveSpec, check_methods, run_curves_for_check, run_equivalence_all
    from unison.methods import METHODS

    spec = overrides_from_namespace(ns, CheckSpec)
    curve = overrides_from_namespace(ns, CurveSpec)
    methods = check_methods(str(spec.pop("method", CheckSpec.method)), METHODS)
    params = parse_params(ns.param)
    reports: list[CheckReport | CurvesReport]
    if curve.get("run"):  # whole `unison train` runs at 1 and W workers, loss curves compared
        reports = [run_curves_for_check(m, spec, curve, params) for m in methods]
    else:                 # every method in one launch of W workers
        reports = list(run_equivalence_all(methods, method_params=params, **spec))
    for report in reports:
        print(report.summary(), flush=True)
    return 0 if all(report.passed for report in reports) else 1


def cmd_plan(ns: argparse.Namespace) -> int:
    """`unison plan`: one rank's memory, FLOPs, bytes and host syncs, from a simulated step; exit 0 when the run fits
    the GPU, 1 when it does not (a verdict, as `unison check`'s 1 when the runs differ), 2 for bad input."""
    from unison.progress import Stages

    with Stages("unison plan") as progress:   # a line from its first second (torch imports for seconds)
        progress.stage("importing torch; reading the options")
        from unison.plan import NO_DATA, plan, resolve_gpu

        gpu = resolve_gpu(ns.gpu)   # bad --gpu before anything slow
        if not option_given(ns, "data"):   # the model and the image size alone, not the default digits
            ns.data = NO_DATA
        cfg = build_train_config(ns, cuda_available=True)   # the job runs on GPUs, not on this machine
        report = plan(cfg, gpu, mfu=ns.mfu, progress=progress)
    print(json.dumps(report.as_dict(), indent=1) if ns.json else report.text(), flush=True)
    return 0 if report.fits else 1


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `unison` parser; with `command`, the other commands are listed but their options not declared (nor the
    `SUBCOMMANDS`' modules imported): a command parses only its own options."""
    parser = LazyEpilogParser(prog="unison", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="self-supervised pre-training (default: SimCLR on digits, 2 workers)",
                             description=TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    cast(LazyEpilogParser, p_train).lazy_epilog = train_epilog   # for --help only: the registries import torch
    add_train_arguments(p_train)
    p_train.set_defaults(func=cmd_train)
    commands: tuple[tuple[str, Callable[[Any, str], None] | str, str], ...] = (*_BUILT_IN, *SUBCOMMANDS)
    for name, declare, help_text in commands:
        if command is not None and command != name:   # listed in `unison --help`; declared when it is the command run
            sub.add_parser(name, help=help_text)
        elif callable(declare):
            declare(sub, help_text)
        else:
            import importlib

            importlib.import_module(declare).add_subcommand(sub, help_text)
    return parser


def _add_plan(sub: Any, help_text: str) -> None:
    p_plan = sub.add_parser("plan", help=help_text, description=PLAN,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p_plan)
    p_plan.add_argument("--gpu", default="h100", metavar="NAME|GIB",
                        help="target GPU: h100 (default), h100-pcie, h200, a100-80, a100-40, l40s, l4, 4090, "
                             "or a memory size in GiB")
    p_plan.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the step-time estimate")
    p_plan.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p_plan.set_defaults(func=cmd_plan)


def _add_check(sub: Any, help_text: str) -> None:
    from unison.config.check import CheckSpec, CurveSpec  # not unison.equivalence: torch is not needed for --help

    p_check = sub.add_parser("check", help=help_text, description=CHECK,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p_check.add_argument("--param", action="append", metavar="NAME=VALUE", help="method hyper-parameter")
    add_dataclass_arguments(p_check, CheckSpec, skip=("method_params",))
    add_dataclass_arguments(p_check, CurveSpec, group_title="whole training runs (--run)")
    p_check.set_defaults(func=cmd_check)


# the commands this module declares besides train: (name, the function that declares its options, one-line help)
_BUILT_IN: tuple[tuple[str, Callable[[Any, str], None], str], ...] = (
    ("plan", _add_plan, "what a run needs per GPU (memory, FLOPs, bytes, host syncs), simulated here"),
    ("check", _add_check, "prove W workers == 1 worker on the global batch (loss, grads, params)"),
)


def version_text() -> str:
    """unison's, torch's (from its metadata: importing torch takes seconds, and every parse builds this) and
    Python's versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from unison.version import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"unison {__version__} (torch {torch_version}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    """Run the command of `argv` (default: the command line); its exit code. Everything it writes goes through
    `_Checked` streams, so a full disk or a closed pipe is one line (or a quiet exit), not an OSError traceback;
    warnings are one line; Ctrl-C at any moment (torch still importing) is ``unison: interrupted``, 130."""
    saved = sys.stdout, sys.stderr, warnings.formatwarning
    sys.stdout, sys.stderr = _Checked(saved[0], "standard output"), _Checked(saved[1], "standard error")
    one_line_warnings()
    worker = False
    try:
        args = sys.argv[1:] if argv is None else argv
        command = next((a for a in args if not a.startswith("-")), "")
        if argv is None and command in WORKER_COMMANDS:   # the `unison` command's own process, not a caller's
            from unison.distributed.start import fork_from_here

            fork_from_here()   # its workers may fork from it
        # train from its first instant (a second of parsing, torch importing): a stop is a line and 75, not 143
        with _stop_before_training() if command == "train" else contextlib.nullcontext():
            ns = make_parser(command).parse_args(args)
            code = _run(ns)
        worker = argv is None and ns.func is cmd_train and _launched_worker()
        sys.stdout.flush()   # here, not in the interpreter's exit ("Exception ignored ... OSError")
    except KeyboardInterrupt:   # outside the command (imports, parsing); the command's own is `_run`'s
        code = _tell(saved[1], "unison: interrupted", INTERRUPTED_EXIT_CODE)
    except Preempted as exc:    # a stop signal to train before its workers ran
        code = _tell(saved[1], f"unison: error: {exc}", exc.exit_code)
    except OutputError as exc:
        code = _output_failed(exc, saved[0], saved[1])
    finally:
        sys.stdout, sys.stderr, warnings.formatwarning = saved
    if worker:
        from unison.distributed.env import exit_worker

        exit_worker(code)   # a torchrun/srun/mpirun worker: skip interpreter finalization (see exit_worker)
    return code


class _Checked:
    """A standard stream whose failed writes raise `OutputError` naming the stream (ENOSPC on ``>/dev/full``,
    EPIPE under ``| head``); everything else is the stream's own."""

    def __init__(self, stream: TextIO, name: str):
        self._stream, self._name = stream, name

    def _failed(self, exc: OSError) -> OutputError:
        return OutputError(f"cannot write to {self._name} ({exc.strerror or exc})", exc.errno, self._name)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _output_failed(exc: OutputError, stdout: TextIO, stderr: TextIO) -> int:
    """Report a failed write on standard error if that one still works; a closed pipe on standard output is a
    quiet exit, as for `yes | head`. Returns the exit code."""
    if exc.stream == "standard error":
        _to_devnull(stderr)
        return exc.exit_code
    _to_devnull(stdout)   # what could not be written would fail again in the interpreter's last flush
    if exc.errno == errno.EPIPE:
        return BROKEN_PIPE_EXIT_CODE
    return _tell(stderr, f"unison: error: {exc}", exc.exit_code)


def _tell(stderr: TextIO, line: str, code: int) -> int:
    """Write `line` on standard error, if it can be written; returns `code`."""
    try:
        stderr.write(line + "\n")
        stderr.flush()
    except (OSError, ValueError):
        _to_devnull(stderr)
    return code


def _to_devnull(stream: TextIO) -> None:
    """Point the process's standard output or error (fd 1 or 2) at /dev/null: its buffer flushes harmlessly."""
    try:
        fd = stream.fileno()
        if fd in (1, 2):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
    except (AttributeError, OSError, ValueError):
        pass


def _launched_worker() -> bool:
    from unison.distributed.launch_env import detect_launch_env

    try:
        return detect_launch_env() is not None
    except ConfigError:   # already reported as this command's error
        return False


def _run(ns: argparse.Namespace) -> int:
    try:
        return ns.func(ns)
    except OutputError:
        raise   # `main` reports it on the stream that still works
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
        lines = exc.lines() if isinstance(exc, ConfigProblems) else [str(exc)]   # several: one line each
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
        text = " ".join(lines[0].split()) or type(exc).__name__
        print(f"unison: {error_prefix(exc)}{where}{text}", *lines[1:], sep="\n", file=sys.stderr)   # every worker is a main()
        return code


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of a failure the user can act on (`unison.errors`); None for a bug."""
    if "RANK" in os.environ and isinstance(exc, RuntimeError):
        from unison.distributed.launch import is_comm_error  # torch: only for a worker's own failure

        if is_comm_error(f"{type(exc).__name__} {exc}"):
            return 1  # under torchrun/srun: this worker lost a peer, whose own failure is the root cause
    return exit_code_of(exc)
