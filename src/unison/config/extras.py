"""How to add one of unison's optional extras (``tensorboard``, ``wandb``, ``mlflow``, ``bench``, ``export``): the one
install command every message that needs one names."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys

from unison.errors import ConfigError

__all__ = ["check_logger_packages", "install_command"]

# the package each --logger needs beyond unison's own (csv and none: nothing)
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


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


def check_logger_packages(logger: str) -> None:
    """`ConfigError` naming the install command when ``--logger`` `logger` lacks a package it needs: before any worker
    starts, not an ImportError on rank 0 after the model was built. MLflow's client alone (mlflow-skinny) logs to a
    tracking server; the run's own SQLite store (no ``MLFLOW_TRACKING_URI``) also needs its SQL packages."""
    package = LOGGER_PACKAGES.get(logger)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--logger {logger} needs the {package} package: {install_command(package)} "
                          "(or use --logger csv)")
    local_store = logger == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI")
    lacking = [p for p in ("sqlalchemy", "alembic") if local_store and importlib.util.find_spec(p) is None]
    if lacking:
        raise ConfigError(f"--logger mlflow keeps the run in a SQLite store under --out, which needs "
                          f"{' and '.join(lacking)}: {install_command('mlflow')} (or name a tracking server: "
                          "MLFLOW_TRACKING_URI=http://HOST:5000)")
