"""The methods guide against the code: each method's recipe as config.json records it, and each method filed under the
backbone its defaults train."""

from __future__ import annotations

import re
from pathlib import Path

from unison.config import TrainConfig
from unison.methods import METHODS
from unison.training.resolve import resolve_recipe

METHODS_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "methods.md"   # the methods table


def test_the_methods_guide_names_each_methods_recipe_as_config_json_records_it(tmp_path):
    """The methods guide: "distill (one view)"; config.json of a distill run on the user's images: ``crop``. Every row of the
    methods table against the recipe a run resolves (and records in config.json) on data other than the digits."""
    table = METHODS_GUIDE.read_text().split("## The methods", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\w+) ([0-9.e-]+), (\w+)[^|]*\|$", table, re.M)
    assert sorted(name for name, *_ in rows) == sorted(METHODS)
    for name, optimizer, lr, augmentation in rows:
        recipe = resolve_recipe(TrainConfig(method=name, data=str(tmp_path)))   # an image folder, not the digits
        assert (recipe.optimizer, recipe.lr, recipe.augmentation) == (optimizer, float(lr), augmentation), name


def test_the_methods_guide_files_each_method_under_the_backbone_its_defaults_train():
    """The guide filed DINO under "A ViT" while `--method dino` at its defaults trains the small CNN: the methods of
    the "A ViT" bullet have a ViT recipe, and DINO's own bullet names the small CNN, its recipe's backbone."""
    start = METHODS_GUIDE.read_text().split("## Which one to start with", 1)[1].split("\n## ", 1)[0]
    bullets = {m.group(1): m.group(2) for m in re.finditer(r"^\* \*\*(.+?)\*\*:?(.*?)(?=^\* |\Z)", start, re.M | re.S)}
    vit = set(re.findall(r"`(\w+)`", bullets["A ViT"])) & set(METHODS)
    assert vit and all(resolve_recipe(TrainConfig(method=m, data="/data")).backbone.startswith("vit_") for m in vit)
    assert "dino" not in vit
    assert resolve_recipe(TrainConfig(method="dino", data="/data")).backbone == "small_cnn"
    assert "trains the small CNN at its defaults" in bullets["DINO"]
