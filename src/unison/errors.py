"""unison's errors: one base class, and the exit code each kind of failure ends the command with.

Every error a user can cause or meet (bad option, bad data, unreadable checkpoint, a loss
that became NaN, a worker that died) is a `UnisonError` whose message is one line that says
what to fix. The CLI prints it as ``unison: error: <message>`` and exits with the class's
`exit_code`; anything else is a bug and keeps its traceback.

    ====  ==========================================================
    code  meaning
    ====  ==========================================================
    1     a worker failed (killed, crashed, timed out)  `WorkerError`
    2     bad configuration or usage (argparse uses 2)  `ConfigError`
    3     bad data                                      `DataError`
    4     a checkpoint cannot be read or written        `CheckpointError`
    5     the loss became NaN or infinite               `NonFiniteLossError`
    75    preempted (SIGTERM/SIGUSR1): a checkpoint was  `Preempted`
          written; run again with --resume auto
    130   interrupted (Ctrl-C)
    141   standard output is a closed pipe (``unison ... | head``): quiet
    ====  ==========================================================

Warnings are one line too, ``unison: warning: <message>`` (`one_line_warnings`, in the CLI and in every worker).

A worker's exception travels to the launching process by its exit code, so a `DataError`
raised on rank 1 ends ``unison train`` with 3, as if it had been raised in the launcher.

Example::

    raise DataError("--data /x has no images; give a folder of images")   # exit code 3
"""

from __future__ import annotations


class UnisonError(Exception):
    """Base class: a failure the user can act on. The message is one line."""

    exit_code: int = 1


class ConfigError(UnisonError, ValueError):
    """A configuration value is invalid."""

    exit_code = 2


class ConfigProblems(ConfigError):
    """Several problems of one input (every problem of a config file, found at once): the CLI prints a line
    naming `where` and then one line per problem; `str()` is all of them on one line (for a log or a caller)."""

    def __init__(self, where: str, problems: list[str]):
        self.where, self.problems = where, list(problems)
        n = len(self.problems)
        super().__init__(f"{where}: {self.problems[0]}" if n == 1 else f"{where} has {n} problems: "
                         + "; ".join(self.problems))

    def lines(self) -> list[str]:
        """The message as the CLI prints it: one line, or a heading and one line per problem."""
        if len(self.problems) == 1:
            return [str(self)]
        return [f"{self.where} has {len(self.problems)} problems; fix them all, then run again:",
                *(f"  {p}" for p in self.problems)]


class RunDirRefused(ConfigError):
    """The run directory is not this run's to write: another live run owns it (`unison.training.owner`), it is
    the data, or a resume would overwrite its later checkpoints. Nothing is written there, not even a log line."""


class DataError(UnisonError, ValueError):
    """The data cannot be read or does not fit the configuration."""

    exit_code = 3


class CheckpointError(UnisonError, RuntimeError):
    """A checkpoint cannot be read, is unsafe, or cannot be written."""

    exit_code = 4


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated or damaged: a run directory falls back to an earlier checkpoint."""


class NonFiniteLossError(UnisonError, FloatingPointError):
    """The loss became NaN or infinite; the last checkpoint is intact."""

    exit_code = 5


class WorkerError(UnisonError, RuntimeError):
    """A worker process failed; `exit_code` is that of the worker's own error (1 if it had none)."""

    exit_code = 1


class WorkerFailure(WorkerError):
    """A worker process failed; `rank` and `cause` say which and why.

    `error_type` is the class name of the worker's exception (None when it was killed or
    exited without one); `exit_code` is the exit code of that exception when it was a
    `UnisonError` (a `DataError` on rank 1 ends the command with 3), else 1; `traceback`
    is the worker's traceback.
    """

    def __init__(self, rank: int, cause: str, error_type: str | None = None, traceback: str = "",
                 exit_code: int | None = None):
        super().__init__(f"worker rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause
        self.error_type = error_type
        self.traceback = traceback
        self.exit_code = exit_code or 1


class WatchdogTimeout(WorkerError):
    """No rank made progress for ``--watchdog-s`` seconds (a hung collective, a stopped worker, a blocked loader)."""

    exit_code = 1


PREEMPTED_EXIT_CODE = 75   # EX_TEMPFAIL (sysexits.h): a temporary failure, the caller is invited to retry


class Preempted(UnisonError):
    """The run was asked to stop (SIGTERM/SIGUSR1), finished its step and wrote a checkpoint."""

    exit_code = PREEMPTED_EXIT_CODE
    mid_step = False   # True: it stopped in the middle of a step of many micro-batches, without a checkpoint of it

    def __init__(self, message: str, *, signal_name: str = "", regroup: bool = False) -> None:
        super().__init__(message)
        self.signal_name = signal_name   # the stop signal ("SIGTERM"); "" where none is known
        # torchrun stopped the workers to re-form the group with nodes that joined: the run goes on, not an error
        # (the CLI's line says what happened without "error", `is_error`)
        self.regroup = regroup

    @property
    def is_error(self) -> bool:
        return not self.regroup


def error_prefix(exc: BaseException) -> str:
    """``error: `` before the line of a failure; nothing for what ends a command without one (torchrun stopping its
    workers to re-form the group with a node that joined: `Preempted.is_error`)."""
    return "" if getattr(exc, "is_error", True) is False else "error: "


INTERRUPTED_EXIT_CODE = 130
BROKEN_PIPE_EXIT_CODE = 141   # 128 + SIGPIPE: what `yes | head -0` reports for `yes`


class OutputError(UnisonError):
    """Standard output or error cannot be written (a full disk, a closed pipe); `errno` says why."""

    def __init__(self, message: str, errno: int | None = None, stream: str = "standard output"):
        super().__init__(message)
        self.errno, self.stream = errno, stream


def one_line_warnings() -> None:
    """Show every warning as one line ``unison: warning: MESSAGE``, without the file, line and source line of
    the code that warned (they are for developers, and a user cannot act on them)."""
    import warnings

    def one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 line: str | None = None) -> str:
        return f"unison: warning: {' '.join(str(message).split())}\n"

    warnings.formatwarning = one_line


class BenchError(RuntimeError):
    """A benchmark run failed; the message names the run and the end of its log."""


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code for `exc`, or None when it is not a `UnisonError` (a bug: keep the traceback)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED_EXIT_CODE
    if isinstance(exc, UnisonError):
        return exc.exit_code
    return None
