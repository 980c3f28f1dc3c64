"""How to add one of unison's optional extras (``tensorboard``, ``wandb``, ``mlflow``, ``bench``, ``export``): the one
install command every message that needs one names."""

from __future__ import annotations

import shlex
import sys

__all__ = ["install_command"]


def install_command(extra: str) -> str:
    """The command that installs unison's optional `extra` into the Python running now: the extra's own
    packages, by name and version, from the installed metadata. Why not ``pip install 'unison[extra]'``: unison
    is not on a package index, so that finds nothing; and a bare ``pip`` may belong to another Python."""
    try:
        from importlib.metadata import PackageNotFoundError, requires

        wanted = f'extra == "{extra}"'
        packages = [r.split(";")[0].strip() for r in requires("unison") or [] if wanted in r]
    except (ImportError, PackageNotFoundError):   # run from a source tree that was never installed
        packages = []
    return f"{shlex.quote(sys.executable)} -m pip install " + " ".join(shlex.quote(p) for p in packages or [extra])
