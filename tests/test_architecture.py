"""The layers of `unison`, checked from the source (ast): every import points down.

Imports made inside functions count like the others (a cycle hidden behind a function-level import is still a
cycle), and so does ``import unison.x as m`` followed by ``m._private``. Each rule is also run on a copy of the
package with one violation planted, and must name it: a rule that cannot fail is no rule. There is no rule on the
length of files or functions: a module is as long as its one subject needs (a trainer may be one file).

The layers, bottom to top (a module may import its own package and the layers below it, nothing beside or above):

    0  errors, version
    1  config/, paths, progress            (import nothing of unison but errors; paths: the output-path rule)
    2  distributed/, rng                   (collectives, dtensor, tagging, sync_batchnorm, env, launch, ...)
    3  models/, data/, losses/, optim/     (plain values and small specs, not TrainConfig)
    4  eval/                               (kNN, probes, fine-tuning: on models, data, losses and optim)
    5  methods/, parallel/                 (DDP, FSDP2, ZeRO-1, comm hooks)
    6  training/                           (resolve, step, trainer, run, checkpoint/)
    7  equivalence/, evaluation/, embedding, export, plan/, plotting
    8  api
    9  cli.train_args                      (a run's options from flags and YAML; bench builds runs with it)
    10 bench/
    11 cli, unison                         (the dispatcher; the package's lazy API)
"""

from __future__ import annotations

import ast
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "unison"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),
    ("config", "paths", "progress"),
    ("distributed", "rng"),
    ("models", "data", "losses", "optim"),
    ("eval",),
    ("methods", "parallel"),
    ("training",),
    ("equivalence", "evaluation", "embedding", "export", "plan", "plotting"),
    ("api",),
    ("cli.train_args",),
    ("bench",),
    ("cli", ""),
]
NO_TRAINING_CONFIG = ("distributed", "data", "models", "losses", "optim", "eval")
LOSSES_MAY_USE = ("unison.distributed.collectives", "unison.distributed.tagging")
ERROR_CLASSES = {node.name for node in ast.parse((SRC / "errors.py").read_text()).body if isinstance(node, ast.ClassDef)}
ERROR_NAME = re.compile(r"(Error|Failure|Exception|Timeout)$")


@dataclass
class Import:
    source: str            # the importing module
    target: str            # the module imported (a submodule when ``from pkg import sub``)
    names: tuple[str, ...]  # the names taken from it (``from target import a, b``)
    line: int

    def where(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass
class Package:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    private_uses: list[str] = field(default_factory=list)   # "source:line uses target._name"


def module_name(root: Path, path: Path) -> str:
    parts = ["unison", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Import], list[str]]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []
    aliases: dict[str, str] = {}   # local name -> unison module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("unison"):
                    found.append(Import(module, _owner(alias.name, modules), (), node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path.name == "__init__.py", node)
            if not base.startswith("unison"):
                continue
            names: list[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:   # ``from pkg import submodule``
                    found.append(Import(module, sub, (), node.lineno))
                    aliases[alias.asname or alias.name] = sub
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(module, _owner(base, modules), tuple(names), node.lineno))
    private = [f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
               and node.attr.startswith("_") and not node.attr.startswith("__")]
    return [i for i in found if i.target != module], private


def analyse(root: Path = SRC) -> Package:
    pkg = Package()
    for path in sorted(root.rglob("*.py")):
        pkg.modules[module_name(root, path)] = path
    for name, path in pkg.modules.items():
        imports, private = _imports_of(name, path, pkg.modules)
        pkg.imports += imports
        pkg.private_uses += private
    return pkg


def layer_of(module: str) -> tuple[int, str]:
    """(layer, group) of a module: the longest group name that is a prefix of its path below ``unison``."""
    rel = module[len("unison."):] if module != "unison" else ""
    best: tuple[int, str] | None = None
    for level, groups in enumerate(LAYERS):
        for group in groups:
            if (rel == group or rel.startswith(group + ".") or group == "") and (best is None or len(group) > len(best[1])):
                best = (level, group)
    assert best is not None, module
    return best


# ---- the rules: each returns the violations as readable lines

def cycles(pkg: Package) -> list[str]:
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in pkg.imports:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    for v in sorted(pkg.modules):
        if v not in index:
            visit(v)
    return found


def upward_imports(pkg: Package) -> list[str]:
    bad = []
    for imp in pkg.imports:
        (src_level, src_group), (dst_level, dst_group) = layer_of(imp.source), layer_of(imp.target)
        if src_group != dst_group and dst_level >= src_level:
            kind = "beside" if dst_level == src_level else "above"
            bad.append(f"{imp.where()} imports {imp.target} (layer {dst_level}, {kind} layer {src_level})")
    return bad


def config_imports(pkg: Package) -> list[str]:
    return [f"{i.where()} imports {i.target}" for i in pkg.imports
            if layer_of(i.source)[1] == "config" and layer_of(i.target)[1] not in ("config", "errors")]


def training_config_in_lower_layers(pkg: Package) -> list[str]:
    bad = []
    for imp in pkg.imports:
        if layer_of(imp.source)[1] not in NO_TRAINING_CONFIG:
            continue
        if imp.target == "unison.config.train" or (imp.target == "unison.config" and "TrainConfig" in imp.names):
            bad.append(f"{imp.where()} imports TrainConfig")
        elif layer_of(imp.target)[1] in ("training", "api", "cli", "cli.train_args"):
            bad.append(f"{imp.where()} imports {imp.target}")
    return bad


def losses_distributed_imports(pkg: Package) -> list[str]:
    return [f"{i.where()} imports {i.target}" for i in pkg.imports
            if layer_of(i.source)[1] == "losses" and i.target.startswith("unison.distributed")
            and i.target not in LOSSES_MAY_USE]


def private_imports(pkg: Package) -> list[str]:
    bad = [f"{i.where()} imports {i.target}.{n}" for i in pkg.imports for n in i.names
           if n.startswith("_") and not n.startswith("__")]
    return bad + pkg.private_uses


def error_classes_elsewhere(pkg: Package) -> list[str]:
    """Error classes live in `unison.errors` and are imported from there: no other module defines one (a class
    named ...Error, ...Failure, ...Exception or ...Timeout) or re-exports one of errors.py's."""
    bad = [f"{i.where()} imports {n} from {i.target}" for i in pkg.imports for n in i.names
           if (n in ERROR_CLASSES or ERROR_NAME.search(n)) and i.target != "unison.errors"]
    for name, path in pkg.modules.items():
        if name != "unison.errors":
            bad += [f"{name}:{node.lineno} defines {node.name}" for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ClassDef) and ERROR_NAME.search(node.name)]
    return bad


RULES = [cycles, upward_imports, config_imports, training_config_in_lower_layers, losses_distributed_imports,
         private_imports, error_classes_elsewhere]


@pytest.fixture(scope="module")
def package() -> Package:
    return analyse()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_package_keeps_the_rule(package, rule):
    assert rule(package) == []


def test_every_module_has_a_layer(package):
    assert len(package.modules) > 100
    for name in package.modules:
        layer_of(name)   # raises on a module no layer names


# ---- a test of the tests: each rule names a violation planted in a copy of the package

PLANTED = {   # rule -> (file, line appended to it, a fragment of the violation the rule must report)
    "cycles": ("rng.py", "def _planted():\n    import unison.distributed.collectives\n", None),
    "upward_imports": ("losses/ntxent.py", "def _planted():\n    from unison.training import step\n",
                       "unison.losses.ntxent"),
    "config_imports": ("config/fields.py", "def _planted():\n    from unison.distributed import collectives\n",
                       "unison.config.fields"),
    "training_config_in_lower_layers": ("data/subsets.py", "def _planted():\n    from unison.config import TrainConfig\n",
                                        "TrainConfig"),
    "losses_distributed_imports": ("losses/byol.py", "from unison.distributed import launch\n", "unison.distributed.launch"),
    "private_imports": ("data/subsets.py", "import unison.rng as _r\n_x = _r._PERM_STREAM\n", "_PERM_STREAM"),
    "error_classes_elsewhere": ("models/heads.py", "from unison.config.train import ConfigError\n\n\n"
                                                   "class HeadError(ValueError):\n    pass\n", "defines HeadError"),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_each_rule_names_a_planted_violation(tmp_path, rule):
    copy = tmp_path / "unison"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert rule(analyse(copy)) == []
    file, code, fragment = PLANTED[rule.__name__]
    if rule is cycles:   # the collectives import rng back: a cycle through a function-level import
        with open(copy / "distributed" / "collectives.py", "a") as f:
            f.write("\n\ndef _planted_back():\n    import unison.rng\n")
        fragment = "unison.distributed.collectives <-> unison.rng"
    with open(copy / file, "a") as f:
        f.write("\n\n" + code)
    found = rule(analyse(copy))
    assert len(found) >= 1 and any(fragment in line for line in found), found
