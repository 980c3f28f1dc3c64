"""Where ``unison bench lightly`` and ``unison bench race`` come from: the lab, ``benchmarks/lab`` of a clone.

The peer comparisons (each method side by side with Lightly SSL, and the race against it at equal wall-clock time)
are no part of the library: they rebuild Lightly's pipelines to measure against, which nothing of unison's own
training needs, and they follow Lightly's releases. They live beside the source tree, in the repository's
``benchmarks/lab`` package (src/unison/../../benchmarks/lab), and `find_lab` imports it from there as
``benchmarks.lab`` (the repository root on ``sys.path``, so that the processes the parts start import it too).
unison installed from a wheel has no lab: the two parts refuse in one line (`not_here`), and ``bench all`` leaves
the Lightly comparison out.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from unison.errors import ConfigError

# The lab's parts, as `unison bench --help` lists them with or without the lab (their descriptions are the lab's)
TITLES = {"lightly": "Side by side with Lightly SSL", "race": "Race against Lightly SSL at equal wall-clock time"}
REPO_ROOT = Path(__file__).resolve().parents[3]   # src/unison/bench/lab.py -> the repository of a clone
LAB = REPO_ROOT / "benchmarks" / "lab"


def find_lab() -> ModuleType | None:
    """The lab package of the repository this unison runs from; None where there is none (a wheel's install)."""
    if not (LAB / "__init__.py").is_file():
        return None
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    lab = importlib.import_module("benchmarks.lab")
    if Path(lab.__file__ or "").resolve().parent != LAB:
        raise ConfigError(f"bench: the lab is {LAB}, but 'benchmarks.lab' imports {lab.__file__} (another "
                          "'benchmarks' package comes first on the Python path); run from the repository root")
    return lab


def not_here(part: str) -> str:
    """Why `part` of the lab cannot run here, in one line (``all``: the warning that it leaves the part out)."""
    if part == "all":
        return (f"the Lightly comparison runs from a clone of the repository (its benchmarks/lab), and this unison "
                f"({Path(__file__).parents[1]}) has none: bench all leaves it out")
    return (f"bench {part} runs from a clone of the repository: the peer comparisons (bench lightly, bench race) "
            f"are its benchmarks/lab, beside src/unison, and this unison ({Path(__file__).parents[1]}) has none; "
            "run it from a clone")
