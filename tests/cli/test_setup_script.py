"""scripts/setup.sh against a fake virtual environment (progress, installing again only when pyproject.toml changes, pip
where uv fails, the main job's needs apart from the tests'), and a wheel built from the repository trained in a
fresh virtual environment outside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


TINY = ["--no-progress", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5"]


FAKE_PYTHON = """#!/bin/sh
# a stand-in for .venv/bin/python: imports work once a fake installer has "installed" torch
case "$*" in *torch*) [ -f "$FAKE_STATE/torch" ] || exit 1 ;; esac
exit 0
"""


FAKE_PIP = """#!/bin/sh
# a stand-in for .venv/bin/pip: shows its configuration, records the rest of its arguments, says what pip says,
# installs the fake uv unless FAKE_NO_UV, fails when asked to
case "$*" in config*) printf '%s\\n' "$FAKE_PIP_CONFIG"; exit 0 ;; esac
echo "pip $*" >> "$FAKE_STATE/pip.log"
echo "Collecting something"
case "$*" in *" uv") [ -z "$FAKE_NO_UV" ] || exit 1; cp "$FAKE_STATE/uv" "$(dirname "$0")/uv"; exit 0 ;; esac
case "$*" in *torch==*) touch "$FAKE_STATE/torch" ;; esac
exit "${FAKE_PIP_EXIT:-0}"
"""


FAKE_UV = """#!/bin/sh
# a stand-in for uv, installed into .venv/bin by the fake pip: records its arguments as the fake pip does, and the
# certificate and proxy it was given; fails when asked to (FAKE_UV_EXIT: a setting it does not take, say)
echo "uv $*" >> "$FAKE_STATE/pip.log"
echo "SSL_CERT_FILE=$SSL_CERT_FILE HTTPS_PROXY=$HTTPS_PROXY" > "$FAKE_STATE/uv.env"
echo "Resolved something"
[ -z "$FAKE_UV_EXIT" ] || exit "$FAKE_UV_EXIT"
case "$*" in *torch==*) touch "$FAKE_STATE/torch" ;; esac
exit "${FAKE_PIP_EXIT:-0}"
"""


PIP_CONFIG = ("global.extra-index-url='file:///a/simple file:///b/simple'\n:env:.find-links='/wheels'\n"
              "global.constraint='/etc/c.txt'\n:env:.cert='/etc/ca.crt'\nglobal.trusted-host='a.example b.example'\n"
              "global.proxy='http://proxy.example:3128'")


def _checkout_with_a_fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of scripts/setup.sh and pyproject.toml, its .venv holding the fakes above: (checkout, state dir)."""
    repo, state = tmp_path / "repo", tmp_path / "state"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    state.mkdir()
    (repo / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    (repo / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    for path, text in ((repo / ".venv" / "bin" / "python", FAKE_PYTHON), (repo / ".venv" / "bin" / "pip", FAKE_PIP),
                       (state / "uv", FAKE_UV)):
        path.write_text(text)
        path.chmod(0o755)
    return repo, state


def _setup(repo: Path, state: Path, *args: str, **env: str) -> tuple[int, str, list[str]]:
    """Run the copy's setup.sh: (exit code, what it printed, the installer commands it ran, 'pip ...' or 'uv ...')."""
    log = state / "pip.log"
    log.unlink(missing_ok=True)
    ours = {k: v for k, v in os.environ.items() if k not in ("HTTPS_PROXY", "HTTP_PROXY", "SSL_CERT_FILE")}
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True, timeout=60,
                          env={**ours, "FAKE_STATE": str(state), "FAKE_PIP_CONFIG": PIP_CONFIG, **env})
    return proc.returncode, proc.stdout + proc.stderr, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_setup_shows_progress_and_installs_again_only_when_pyproject_changes(tmp_path, installer):
    """uv where pip can install it, given pip's indexes, links and constraints; pip where it cannot (FAKE_NO_UV)."""
    repo, state = _checkout_with_a_fake_venv(tmp_path)
    no_uv = {"FAKE_NO_UV": "1"} if installer == "pip" else {}
    code, shown, runs = _setup(repo, state, **no_uv)
    assert code == 0, shown
    assert runs[0] == "pip install --disable-pip-version-check -q uv", runs   # uv asked for once, quietly
    installs = runs[1:]
    assert [r.split()[-1] for r in installs] == ["torchvision==0.29.1", ".[test]"] and not any(" -q" in r for r in installs)
    assert all(r.startswith(installer + " ") for r in installs), installs
    if installer == "uv":
        assert all("--compile-bytecode --index-strategy unsafe-best-match --extra-index-url file:///a/simple "
                   "--extra-index-url file:///b/simple --find-links /wheels --constraint /etc/c.txt "
                   "--allow-insecure-host a.example --allow-insecure-host b.example" in r for r in installs), installs
        uv_env = (state / "uv.env").read_text().split()
        assert uv_env == ["SSL_CERT_FILE=/etc/ca.crt", "HTTPS_PROXY=http://proxy.example:3128"], uv_env
    assert "setup: installing torch 2.14.1" in shown and "something" in shown   # not silent
    assert "setup: installing unison from" in shown
    code, shown, runs = _setup(repo, state, **no_uv)   # nothing changed: no installer at all
    assert code == 0 and runs == [] and "up to date" in shown, shown
    with open(repo / "pyproject.toml", "a") as f:
        f.write("# a dependency added\n")
    code, shown, runs = _setup(repo, state, FAKE_PIP_EXIT="1", **no_uv)   # changed, and the install fails
    assert code == 1 and "installing unison failed" in shown, shown
    tried = [r.split()[0] for r in runs if not r.endswith(" uv")]
    assert tried == (["uv", "pip"] if installer == "uv" else ["pip"]), runs   # where uv failed, pip tried too
    code, shown, runs = _setup(repo, state, **no_uv)   # so the next run installs again
    assert code == 0 and [r.split()[-1] for r in runs if not r.endswith(" uv")] == [".[test]"], shown
    assert _setup(repo, state, **no_uv)[2] == []


def test_the_main_jobs_setup_installs_what_it_needs_and_the_tests_add_the_rest(tmp_path):
    """./run.sh's set-up (`setup.sh main`) installs unison and its runtime dependencies, not the test toolchain;
    the tests' (`setup.sh`) adds it once; each is idempotent, and a checkout set up for the tests is set up for the
    main job."""
    repo, state = _checkout_with_a_fake_venv(tmp_path)
    code, shown, runs = _setup(repo, state, "main")
    assert code == 0 and [r.split()[-1] for r in runs[1:]] == ["torchvision==0.29.1", "."], shown
    assert "with the test toolchain" not in shown
    code, shown, runs = _setup(repo, state, "main")
    assert code == 0 and runs == [] and "up to date" in shown, shown
    code, shown, runs = _setup(repo, state)   # scripts/test.sh's: the test extra, once
    assert code == 0 and [r.split()[-1] for r in runs] == [".[test]"] and "with the test toolchain" in shown, shown
    assert _setup(repo, state)[2] == [] and _setup(repo, state, "main")[2] == []
    code, shown, _ = _setup(repo, state, "everything")
    assert code == 2 and "unknown set-up 'everything'" in shown, shown


def test_setup_installs_with_pip_where_uv_fails(tmp_path):
    """uv installed but unable to install (a setting of pip's it does not take, an index it cannot reach): pip
    installs what uv could not, and the rest of the setup, and says so in one line."""
    repo, state = _checkout_with_a_fake_venv(tmp_path)
    code, shown, runs = _setup(repo, state, FAKE_UV_EXIT="2")
    assert code == 0, shown
    assert [r.split()[0] + " " + r.split()[-1] for r in runs[1:]] == [
        "uv torchvision==0.29.1", "pip torchvision==0.29.1", "pip .[test]"], runs
    assert "setup: uv could not install torch==2.14.1 torchvision==0.29.1 (its output is above): installing with pip " \
           "instead" in shown, shown
    assert _setup(repo, state)[2] == []   # installed: nothing the next time


def test_a_wheel_from_the_repository_trains_in_a_fresh_venv_outside_it(tmp_path):
    """`python -m build`, the wheel installed into a new virtual environment, `unison train` run from a folder
    outside the repository with nothing of it on the path. Offline: the wheel's dependencies (torch, ...) are this
    environment's, seen through a .pth file (a new venv cannot download them here); unison itself is the wheel's."""
    import shutil
    import sysconfig

    source = tmp_path / "source"   # what the wheel is built from: the repository's own files, copied
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("unison-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                               capture_output=True, text=True, env=clean, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([python, "-c", "import unison; print(unison.__file__)"], cwd=elsewhere, env=clean,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    trained = subprocess.run([venv / "bin" / "unison", "train", *TINY, "--max-steps", "2", "--out", "run"],
                             cwd=elsewhere, env={**clean, "UNISON_NO_CACHE": "1"}, capture_output=True, text=True,
                             timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.stdout.startswith("simclr x2 workers, 2 steps, ") and "kNN top-1 0." in trained.stdout
    assert json.loads((elsewhere / "run" / "summary.json").read_text())["data"] == "digits"
