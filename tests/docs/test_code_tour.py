"""docs/guides/code-tour.md names every module of ``src/unison`` and nothing that is not there.

The rule for naming a module: its path relative to ``src/unison``, verbatim and in backticks, a package's
``__init__.py`` included (``cli/__init__.py``; the package itself is ``__init__.py``). Each module has one entry in
the page's module list, a line of the form ``- `training/step.py`: what it is for``. The other way round, every
backticked path in the page that looks like a module (``*.py``) or a package folder (``name/``) must exist (under
``src/unison``, or in the repository where its first folder is a top-level one such as ``tests/``), and so must
every backticked dotted name ``unison.x.y``. The page's layer table must give each layer of
`tests/test_architecture.py` the packages and modules that test assigns it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "unison"
PAGE = ROOT / "docs" / "guides" / "code-tour.md"

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
ENTRY = re.compile(r"^- `([^`]+\.py)`: (.*)$", re.M)
MODULE_PATH = re.compile(r"^[\w./]*\w\.py$")
FOLDER_PATH = re.compile(r"^\w[\w/]*/$")
DOTTED = re.compile(r"^unison(\.\w+)+$")
LAYER_LINE = re.compile(r"^\s*(\d+)\s+(.*)$")


def modules() -> list[str]:
    return sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py"))


def prose(text: str) -> str:
    return FENCE.sub("", text)


def entries(text: str) -> list[tuple[str, str]]:
    return ENTRY.findall(prose(text))


def missing_modules(text: str) -> list[str]:
    listed = {path for path, what in entries(text) if what.strip()}
    return [m for m in modules() if m not in listed]


def _repository_path(path: str) -> Path:
    """A path of the page: in the repository where its first folder is a top-level one of the repository (not a
    package of unison), else under src/unison."""
    first = path.split("/", 1)[0]
    top = {p.name for p in ROOT.iterdir() if p.is_dir()} - {p.name for p in SRC.iterdir()}
    return (ROOT / path) if first in top else (SRC / path)


def _dotted_exists(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def dead_names(text: str) -> list[str]:
    """The page's backticked paths and dotted names that do not exist."""
    dead = []
    for code in INLINE.findall(prose(text)):
        code = code.strip()
        if MODULE_PATH.match(code):
            if not _repository_path(code).is_file():
                dead.append(code)
        elif FOLDER_PATH.match(code):
            if not _repository_path(code).is_dir():
                dead.append(code)
        elif DOTTED.match(code) and not _dotted_exists(code):
            dead.append(code)
    return dead


def architecture_layers() -> list[tuple[str, ...]]:
    tree = ast.parse((ROOT / "tests" / "test_architecture.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "LAYERS":
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_architecture.py defines no LAYERS")


def layer_table(text: str) -> dict[int, list[str]]:
    """The layer table (the fenced block whose lines start with the layer's number): level -> its words."""
    for block in FENCE.findall(text):
        rows = [LAYER_LINE.match(line) for line in block.splitlines()[1:-1]]
        if rows and all(rows):
            return {int(m.group(1)): m.group(2).split() for m in rows if m}
    return {}


def _as_path(group: str) -> str:
    """A group of test_architecture's LAYERS as the page names it: ``config/``, ``paths.py``, ``cli/train_args.py``,
    and ``__init__.py`` for the package itself (the empty group)."""
    if not group:
        return "__init__.py"
    path = group.replace(".", "/")
    return f"{path}/" if (SRC / path).is_dir() else f"{path}.py"


def layer_problems(text: str) -> list[str]:
    table = layer_table(text)
    layers = architecture_layers()
    problems = [f"the table has layer {level}, the architecture test does not" for level in table
                if level >= len(layers)]
    for level, groups in enumerate(layers):
        words = table.get(level)
        if words is None:
            problems.append(f"layer {level} is not in the table")
            continue
        problems += [f"layer {level} lacks {_as_path(g)}" for g in groups if _as_path(g) not in words]
        problems += [f"layer {level} names {w}, which does not exist" for w in words
                     if (MODULE_PATH.match(w) or FOLDER_PATH.match(w)) and not (SRC / w).exists()]
    return problems


TEXT = PAGE.read_text()


def test_every_module_has_an_entry_with_what_it_is_for():
    assert len(modules()) > 100   # the package is there, not an empty glob
    assert not missing_modules(TEXT), f"code-tour.md lists no `path`: entry for {missing_modules(TEXT)}"


def test_each_module_is_listed_once():
    paths = [path for path, _ in entries(TEXT)]
    assert len(paths) == len(set(paths)), sorted({p for p in paths if paths.count(p) > 1})


def test_every_path_and_module_name_the_page_shows_exists():
    assert not dead_names(TEXT), f"code-tour.md names what does not exist: {dead_names(TEXT)}"


def test_the_layer_table_is_the_architecture_tests():
    assert layer_table(TEXT), "code-tour.md has no layer table (a fenced block of numbered lines)"
    assert not layer_problems(TEXT), layer_problems(TEXT)


@pytest.mark.parametrize("module", ["training/step.py", "cli/__init__.py", "__init__.py", "losses/ntxent.py"])
def test_a_removed_entry_is_named(module):
    line = next(ln for ln in TEXT.splitlines() if ln.startswith(f"- `{module}`:"))
    assert missing_modules(TEXT.replace(line + "\n", "")) == [module]


@pytest.mark.parametrize("planted", ["training/loop.py", "training/loop_hooks.py", "distributed/no_such/",
                                     "unison.training.loop", "unison.training.step.no_such_function",
                                     "tests/no_such_test.py"])
def test_a_name_that_does_not_exist_is_named(planted):
    assert dead_names(TEXT + f"\nSee `{planted}`.\n") == [planted]


def test_a_layer_the_table_moves_or_drops_is_named():
    table = next(block for block in FENCE.findall(TEXT) if layer_table(block))
    moved = table.replace(" 6  training/", " 6  ").replace("11  cli/", "11  cli/  training/")
    assert "layer 6 lacks training/" in layer_problems(TEXT.replace(table, moved))
    dropped = "\n".join(ln for ln in table.splitlines() if not ln.startswith(" 8 "))
    assert "layer 8 is not in the table" in layer_problems(TEXT.replace(table, dropped))
