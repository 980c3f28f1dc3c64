"""How the launcher's workers are started: forked from a fork server, or from the `unison` command's own process.

* **The fork server** (the default; ``spawn`` where the platform has none): a server process that started clean
  and imported torch and the target's module once. It never ran an op, so no CUDA, thread or OpenMP state of the
  launcher leaks into a worker, nor a user's own state (a monkeypatch, a global flag), and a worker starts with a
  fork, not a new interpreter importing torch. The server lives as long as the launching process, so further
  launches from it (a Python session, the test suite) start workers at once.
* **Forked from the launching process itself**, where that process is the ``unison`` command (`fork_from_here`:
  it holds unison's own state and no user code) and forking it is safe: Linux, no thread but those it had when the
  command began (no lock another thread could hold, no OpenMP pool), and no GPU device on the machine (CUDA is
  not fork-safe: a parent that only asked how many devices there are poisons it, and the command's parent asks).
  The command has imported torch already,
  so the fork server would import it a second time, a CPU-bound import that a short ``unison train`` would pay
  in its start again. A GPU machine, or any other process, keeps the fork server.

The workers of both get the launcher's environment as it is at launch (`unison.distributed.launch`).

Both the fork server and spawn import the launching script in every worker (``__main__``, so that its functions and
classes unpickle there), which makes two mistakes of a user's script fail in every worker:

* a script that is no file (``python - < train.py``: ``<stdin>``) cannot be imported, and every worker would die
  with a traceback about it. `refuse_unimportable_main` says so in one line before any worker starts;
* a script without ``if __name__ == "__main__":`` that calls ``unison.train`` at its top level trains again inside
  each worker, which then meets the run directory its parent holds (``in use by another run``: the wrong way to
  send the user). `refuse_reentered_main`, called first by ``unison.train`` and ``unison.check``, sees that
  start-up (multiprocessing's ``_inheriting``, the flag behind its own "bootstrapping phase" error): a unison worker
  exits at once with `REENTERED_MAIN_EXIT`, and its launcher (`unison.distributed.launch`) raises one
  `ConfigError` naming the guard, instead of W tracebacks.

Example::

    refuse_reentered_main("unison.train")   # nothing, unless this process is a worker importing the script
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from typing import Any

from unison.config.distributed import gpu_device_node_found
from unison.errors import ConfigError

from .signals import stop_signals_blocked

# This process's threads when `fork_from_here` was called; None: not called (or no /proc), never forked from here.
_THREADS_AT_START: frozenset[str] | None = None


def _threads() -> frozenset[str] | None:
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:   # no /proc: unknown
        return None


def _preload(target: Callable[[Any], Any]) -> list[str]:
    # torch._dynamo: DDP imports it when it wraps a model (seconds in every worker), so once, before the forks
    return ["torch", "torch._dynamo", target.__module__]


def fork_from_here() -> None:
    """Fork this process's workers from it where that is safe (see the module docstring): for the ``unison``
    command's own process only, never a library user's (their state would leak into the workers). Call it first:
    the threads running now are the ones a fork may find (NumPy's OpenBLAS starts its pool when imported, here,
    and is fork-safe); any started later, OpenMP's pool after torch's first parallel op above all (a worker forked
    from it hangs at its own first one), leave the workers to the fork server."""
    global _THREADS_AT_START
    import numpy  # noqa: F401  (its thread pool, into the snapshot)

    _THREADS_AT_START = _threads()


def _forkable() -> bool:
    """This process can be forked into workers: Linux, no thread but those it had at `fork_from_here`, CUDA
    untouched, no GPU device."""
    if not (sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()):
        return False
    if gpu_device_node_found():   # workers never fork from a process that may have touched a GPU
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    now = _threads()
    return _THREADS_AT_START is not None and now is not None and now <= _THREADS_AT_START


def _unimportable_main() -> str | None:
    """The launching script as multiprocessing would import it in a worker, when that file does not exist (a script
    read from standard input, ``<stdin>``; one deleted since it started); None when there is nothing to import (the
    interactive interpreter, a notebook, ``python -c``) or it can be (a file, ``python -m module``)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None
    from multiprocessing import process

    full = os.path.join(getattr(process, "ORIGINAL_DIR", None) or "", path)   # as multiprocessing's spawn resolves it
    return None if os.path.isfile(full) else path


def refuse_unimportable_main(world_size: int) -> None:
    """`ConfigError` (one line) before any worker starts when the workers could not import the launching script."""
    path = _unimportable_main()
    if path is None:
        return
    what = "a script read from standard input" if path.startswith("<") else f"{path}, which no longer exists"
    raise ConfigError(f"the {world_size} worker processes start by importing the script that launched them, and this "
                      f"one is {what}: save it to a file and run it as python FILE.py, or use world_size=1 (training in "
                      "this process, no workers)")


REENTERED_MAIN_EXIT = 86   # a worker that found itself re-running the user's script
WORKER_NAME = "unison-rank"   # unison's workers are unison-rank0, unison-rank1, ...


def refuse_reentered_main(call: str) -> None:
    """`call` runs while this process is being started by multiprocessing, importing the parent's main module: in a
    unison worker, exit at once (its launcher says why, once); in another process (the user's own pool), the same
    one line as a `ConfigError`."""
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    if mp.current_process().name.startswith(WORKER_NAME):
        os._exit(REENTERED_MAIN_EXIT)
    raise ConfigError(reentered_main_message(call))


def reentered_main_message(call: str) -> str:
    import __main__

    script = getattr(__main__, "__file__", None) or "your script"
    return (f"{call} ran again in each worker process, which imports {script} from the top (as Python's "
            f'multiprocessing does): put that call under `if __name__ == "__main__":` in {script}')


def start_context(target: Callable[[Any], Any], world_size: int = 2) -> Any:   # a Fork-, ForkServer- or SpawnContext
    """The context that starts `target`'s workers (the module docstring says which)."""
    if _THREADS_AT_START is not None:
        for module in _preload(target):   # what a fork server would import, here before the check: an import that
            importlib.import_module(module)   # started a thread is then seen
        if _forkable():
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()   # one for all workers, as with the fork server: a worker's own died with it
            return mp.get_context("fork")
    refuse_unimportable_main(world_size)   # fork server and spawn: every worker imports __main__
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload(target))   # the first launch starts the server
    try:
        from multiprocessing import forkserver, resource_tracker

        # the tracker first: starting it unblocks SIGTERM in this thread (its own start blocks and then unblocks it)
        resource_tracker.ensure_running()
        with stop_signals_blocked():   # the server and its children inherit the mask: see `stop_signals_blocked`
            forkserver.ensure_running()
    except OSError:   # e.g. "AF_UNIX path too long": the server's socket lives in the temporary folder (TMPDIR)
        return mp.get_context("spawn")
    return ctx


class LauncherStream:
    """The launcher's stdout or stderr as it is at launch (a test's capture, a redirect), handed to a worker: the
    fork server's own are those of its start. Pickled into a descriptor the worker inherits (`attach`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_InheritedStream, (reduction.DupFd(self.fd), self.fd))   # runs while the worker is started


class _InheritedStream:
    def __init__(self, dup: Any, fd: int) -> None:
        self.dup, self.fd = dup, fd

    def attach(self) -> None:
        inherited = self.dup.detach()
        os.dup2(inherited, self.fd)
        os.close(inherited)


def release_fork_server() -> None:
    """Close this worker's copy of the fork server's "launcher alive" pipe.

    Why: Python gives every child of the fork server the write end of that pipe (so that a child could start
    processes through the server too), and the server exits only when every copy is closed. The workers'
    copies kept it alive after a SIGKILLed launcher, and it kept them alive (they die with their parent, the
    server): a run that outlived its launcher. Workers start no processes through the server."""
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        alive_fd = getattr(server, "_forkserver_alive_fd", None)
        if alive_fd is not None:
            os.close(alive_fd)
            server._forkserver_alive_fd = None   # type: ignore[attr-defined]
    except (AttributeError, OSError):   # another Python's internals, or already closed: nothing held
        pass
