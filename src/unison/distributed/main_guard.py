"""A user's script without ``if __name__ == "__main__":``, re-run by the worker processes.

Python's spawn and forkserver start methods import the parent's main module in every child before it runs its
target, so a script that calls ``unison.train`` at its top level trains again inside each worker, which then meets
the run directory its parent holds (``in use by another run``: the wrong way to send the user). `refuse_reentered_main`,
called first by ``unison.train`` and ``unison.check``, sees that start-up (multiprocessing's ``_inheriting``, the
flag behind its own "bootstrapping phase" error): a unison worker exits at once with `REENTERED_MAIN_EXIT`, and
its launcher (`unison.distributed.launch`) raises one `ConfigError` naming the guard, instead of W tracebacks.

Example::

    refuse_reentered_main("unison.train")   # nothing, unless this process is a worker importing the script
"""

from __future__ import annotations

import multiprocessing as mp
import os

from unison.errors import ConfigError

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
