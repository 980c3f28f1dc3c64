"""The README's library example as a user runs it: its snippet imports and guards its main, the example trains an
encoder better than the random one (and every page shows that one example), and a script without the main guard is
told so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import unison

REPO = Path(__file__).resolve().parents[2]


SRC = str(Path(unison.__file__).resolve().parents[1])   # the unison under test, also in the processes started here


# the example of the README: unison.train(TrainConfig(method=M, epochs=N, ...))
TRAIN_CALL = re.compile(r"unison\.train\((TrainConfig\(method=\"\w+\", epochs=\d+[^#\n]*\))\)")


# a training of the same kind anywhere a user reads one: a page, a docstring (help(unison)), an example
TRAIN_EXAMPLE = re.compile(r"TrainConfig\(method=\"\w+\", epochs=\d+")


def _library_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    return readme.split("## As a library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_library_snippet_imports_and_guards_its_main():
    snippet = _library_snippet()
    compile(snippet, "README.md", "exec")
    head = snippet.split("\nif __name__", 1)[0]   # what runs on import: the imports only
    namespace: dict = {}
    exec(compile(head, "README.md", "exec"), namespace)
    assert "DistributedConfig" in namespace and 'if __name__ == "__main__":' in snippet
    from unison.config import DistributedConfig
    from unison.distributed import DistributedConfig as where_users_look

    assert where_users_look is DistributedConfig


def _pages_with_train_examples() -> dict[str, list[str]]:
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "src" / "unison").rglob("*.py"),
             *(REPO / "examples").rglob("*.py")]
    found = {str(f.relative_to(REPO)): TRAIN_EXAMPLE.findall(f.read_text()) for f in files}
    return {page: calls for page, calls in found.items() if calls}


def test_the_library_example_beats_random_init_and_every_page_shows_that_one(tmp_path):
    """The first number a library user sees must show the point: the README's `unison.train(...)` line, run as
    written (only its run directory moved here), ends clearly above the random encoder's kNN (BYOL at 10 epochs had
    ended below it: 0.7493 against 0.7577). Every page, docstring and example that trains one the same way shows the
    same method and length (help(unison) showed BYOL after the README moved on)."""
    from unison.config import DistributedConfig, TrainConfig

    (call,) = TRAIN_CALL.findall(_library_snippet())
    want = TRAIN_EXAMPLE.match(call).group(0)   # TrainConfig(method="...", epochs=N
    shown = _pages_with_train_examples()
    assert {"README.md", "docs/guides/own-pieces.md", "src/unison/api.py", "src/unison/__init__.py"} <= set(shown)
    other = {page: calls for page, calls in shown.items() if any(c != want for c in calls)}
    assert not other, (want, other)
    cfg = eval(call, {"TrainConfig": TrainConfig, "DistributedConfig": DistributedConfig})
    cfg.out, cfg.progress = str(tmp_path / "run"), False
    summary = unison.train(cfg)
    assert summary.knn_top1 >= summary.random_init_knn_top1 + 0.05, summary.result_line()


def test_a_script_without_the_main_guard_is_told_so(tmp_path):
    """The workers import the user's script; without the guard it trains again in each of them. Before: `RunDirRefused:
    run directory ... is in use by another run (pid <the script>)`, which sends the user the wrong way."""
    script = tmp_path / "train_digits.py"
    script.write_text("import unison\nfrom unison.config import DistributedConfig, TrainConfig\n\n"
                      "unison.train(TrainConfig(max_steps=1, batch_size=32, subset=128, val_subset=32, knn_k=5, "
                      f"random_init_knn=False, out={str(tmp_path / 'run')!r}, "
                      "distributed=DistributedConfig(world_size=2)))\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "in use by another run" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("unison.errors.ConfigError: the call that started the workers (unison.train, unison.check) ran "
                    f"again in each worker process, which imports {script} from the top (as Python's multiprocessing "
                    f'does): put that call under `if __name__ == "__main__":` in {script}'), proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1   # the script's own, ending in that line: no worker's traceback
