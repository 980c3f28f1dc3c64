"""The documentation site builds strictly (`mkdocs build --strict`, as `scripts/docs.sh` runs it), and fails on what a
reader would stumble on: a dead link, an API object that does not resolve. The planted cases build a copy of
``docs/`` beside links to the rest of the repository, so the repository itself is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]')")
pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[test]')")


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def linked_copy(tmp_path: Path) -> Path:
    """The repository's top level as links, with a real copy of docs/ and mkdocs.yml to plant defects in."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", "mkdocs.yml", "build", ".git", ".venv"):
            (root / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


def test_the_site_builds_strictly_with_every_page_and_the_api_reference(tmp_path):
    proc = build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "guides/methods.html", "reference/cli.html", "reference/api.html",
                 "reference/losses.html", "benchmarks.html", "reliability.html"):
        assert (site / page).is_file(), page
    api = (site / "reference/api.html").read_text()
    assert all(f'id="unison.api.{name}"' in api for name in ("train", "check", "evaluate"))
    losses = (site / "reference/losses.html").read_text()
    assert "NTXentLoss" in losses and "gather" in losses   # the docstrings, rendered
    cli = (site / "reference/cli.html").read_text()
    assert "--world-size" in cli and "unison-help" not in cli   # every placeholder became the command's --help


@pytest.mark.parametrize("planted, expected", [
    ("See [the guide](guides/no-such-page.md).", "no-such-page.md"),
    ("See [the test](../tests/no_such_test.py).", "no_such_test.py"),
    ("::: unison.losses.NoSuchLoss", "NoSuchLoss"),
], ids=["dead-page-link", "dead-repository-link", "unresolvable-api-object"])
def test_a_planted_defect_fails_the_build(tmp_path, planted, expected):
    root = linked_copy(tmp_path)
    page = root / "docs" / "guides" / "methods.md"
    page.write_text(page.read_text() + "\n\n" + planted + "\n")
    proc = build(root, tmp_path / "site")
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
