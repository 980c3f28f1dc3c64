"""The front door's defects that need no process: the README's recipe column against what a run records, and the
default world size on a machine with GPUs (simulated: torch's device count patched, in process)."""

from __future__ import annotations

import re
from pathlib import Path

from unison.config import TrainConfig
from unison.methods import METHODS
from unison.training.resolve import resolve_recipe

README = Path(__file__).resolve().parents[3] / "README.md"


def test_the_readme_names_each_methods_recipe_as_config_json_records_it(tmp_path):
    """README: "distill (one view)"; config.json of a distill run on the user's images: ``crop``. Every row of the
    methods table against the recipe a run resolves (and records in config.json) on data other than the digits."""
    table = README.read_text().split("## Methods", 1)[1].split("\n\n", 3)[2]
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\w+) ([0-9.e-]+), (\w+)[^|]*\|$", table, re.M)
    assert sorted(name for name, *_ in rows) == sorted(METHODS)
    for name, optimizer, lr, augmentation in rows:
        recipe = resolve_recipe(TrainConfig(method=name, data=str(tmp_path)))   # an image folder, not the digits
        assert (recipe.optimizer, recipe.lr, recipe.augmentation) == (optimizer, float(lr), augmentation), name
