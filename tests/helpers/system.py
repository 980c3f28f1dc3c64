"""Real infrastructure for the cluster tests: Debian packages installed on demand, and why a test must skip.

The tests that run under a real SLURM, Open MPI or on several network-namespace hosts install what they need from
the Debian package index when it is missing (CI machines start bare), once per test session, and skip with one
line saying why where they cannot (not root, no apt-get, no package index reachable). Nothing here is needed by
unison itself; a user's cluster brings its own scheduler.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator

APT_TIMEOUT_S = 600
APT_LOCK = "/tmp/unison-tests-apt.lock"   # pytest workers (scripts/test.sh) may each need packages


@contextlib.contextmanager
def _one_installer() -> Iterator[None]:
    with open(APT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@functools.cache
def _apt_updated() -> str | None:
    """Refresh the package index once per session; the failure's last line, or None."""
    proc = subprocess.run(["apt-get", "update"], capture_output=True, text=True, timeout=APT_TIMEOUT_S)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return lines[-1] if lines else f"apt-get update exited {proc.returncode}"
    return None


def missing_programs(programs: dict[str, str]) -> dict[str, str]:
    """The subset of `programs` (program -> the Debian package that ships it) not found on PATH or in sbin."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return {prog: pkg for prog, pkg in programs.items() if shutil.which(prog, path=path) is None}


@functools.cache
def _install(packages: tuple[str, ...]) -> str | None:
    if (update_error := _apt_updated()) is not None:
        return f"apt-get update failed: {update_error}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *packages], env=env,
                          capture_output=True, text=True, timeout=APT_TIMEOUT_S)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return f"apt-get install {' '.join(packages)} failed: {lines[-1] if lines else proc.returncode}"
    return None


def ensure_programs(programs: dict[str, str]) -> str | None:
    """Install the Debian packages of the missing `programs`; None when all are there, else why a test must skip."""
    missing = missing_programs(programs)
    if not missing:
        return None
    packages = tuple(sorted(set(missing.values())))
    if os.geteuid() != 0:
        return f"needs {', '.join(packages)} (missing {', '.join(missing)}) and installing them needs root"
    if shutil.which("apt-get") is None:
        return f"needs {', '.join(packages)} (missing {', '.join(missing)}) and this machine has no apt-get"
    with _one_installer():
        if missing_programs(programs) and (error := _install(packages)) is not None:   # the other worker's may be done
            return error
    still = missing_programs(programs)
    return f"installed {', '.join(packages)} but {', '.join(still)} is still missing" if still else None


def sbin(program: str) -> str:
    """The full path of `program`, looked up also in /usr/sbin and /sbin (daemons live there)."""
    found = shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise FileNotFoundError(program)
    return found
