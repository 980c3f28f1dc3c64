"""Write ``examples/configs/<method>_<dataset>.yaml``: every method's recipe at CIFAR-10 size and at ImageNet size.

    python scripts/write_configs.py            # (re)write every file (a new method gets its two files, and its
                                               # row in docs/guides/methods.md's table of them)
    python scripts/write_configs.py --check    # exit 1 naming each file that is missing or differs

Each file is what ``unison train`` resolves for the method when nothing but the data set's setting is given,
written out: the optimizer, base learning rate, weight decay, augmentation and local crops of the method's
`Recipe` at that image size, every field of its ``Params`` dataclass with its default, and the schedule of the
data set's setting (`SETTINGS`: epochs, global batch, warm-up, backbone by family). Nothing here is a second
recipe: a value that differs from the method's is a bug of this script. Hand-written (not a YAML dump) so that
each file carries the comments a user reads first: where each value comes from and what to replace.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "examples" / "configs"
GUIDE = ROOT / "docs" / "guides" / "methods.md"   # its table of the files, between these two lines
TABLE_START, TABLE_END = "<!-- config files: written by scripts/write_configs.py -->", "<!-- end of config files -->"


@dataclass(frozen=True)
class Setting:
    """What a data set's files share: the data, its image size, the schedule and a backbone per family."""

    title: str
    short: str          # the link's text in the guide's table
    image_size: int
    data: str
    val: str
    data_comment: str
    epochs: int
    batch_size: int
    warmup_epochs: int
    eval_every: int
    cnn: str            # the backbone of the methods whose recipe trains a CNN
    vit: str            # ... and of those whose recipe names a ViT
    source: str         # where the schedule comes from
    backbone_note: dict[str, str]
    distill_student: str
    distill_teacher: str
    extra: tuple[tuple[str, Any, str], ...] = ()   # further options (key, value, comment)


SETTINGS = {
    "cifar10": Setting(
        title="CIFAR-10 (32 px)", short="32 px", image_size=32, data="cifar10", val="cifar10",
        data_comment="torchvision's CIFAR-10 (val: its test set); or your copy's ImageFolder directories",
        epochs=200, batch_size=512, warmup_epochs=10, eval_every=20, cnn="resnet18", vit="vit_tiny_auto",
        source="Lightly's CIFAR-10 benchmark (ResNet-18, batch 512, 200 epochs)",
        backbone_note={"resnet18": "ResNet-18 with the CIFAR stem (3x3 conv, no max-pool) at 32 px",
                       "vit_tiny_auto": "ViT-Tiny, its patch size from the image size: 4 px at 32 px (8 x 8 patches)",
                       "small_cnn": "unison's small CNN (the student: small enough to deploy anywhere)"},
        distill_student="small_cnn", distill_teacher="runs/byol_cifar10"),
    "imagenet": Setting(
        title="an ImageNet-style folder (224 px)", short="224 px", image_size=224, data="/data/imagenet/train",
        val="/data/imagenet/val",
        data_comment="replace with your ImageFolder directories (<split>/<class>/<image>.JPEG, as ImageNet's "
                     "train/ and val/ are usually laid out); any --data layout works (file lists, tar shards)",
        epochs=100, batch_size=256, warmup_epochs=10, eval_every=10, cnn="resnet50", vit="vit_small_auto",
        source="Lightly's ImageNet benchmarks (ResNet-50, batch 256 = 2 GPUs x 128, 100 epochs)",
        backbone_note={"resnet50": "ResNet-50 with the ImageNet stem (7x7 conv, max-pool) at 224 px",
                       "vit_small_auto": "ViT-S, its patch size from the image size: 16 px at 224 px (ViT-S/16)",
                       "resnet18": "ResNet-18 with the ImageNet stem (the student)"},
        distill_student="resnet18", distill_teacher="runs/dino_imagenet",
        extra=(("amp", "bf16", "bf16 autocast on the GPUs (or a recent CPU); --amp none for float32"),)),
}


def scalar(value: Any) -> str:
    """`value` as a YAML scalar any YAML 1.1 reader types as unison does (``1.0e-06``, not ``1e-06``: a string
    to PyYAML)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


WIDTH = 110


def line(key: str, value: Any, comment: str = "", indent: int = 0) -> list[str]:
    """``key: value``, its comment beside it, or above it where the line would pass `WIDTH`."""
    text = " " * indent + f"{key}: {scalar(value)}"
    if not comment:
        return [text]
    beside = f"{text:<40} # {comment}"
    if len(beside) <= WIDTH:
        return [beside]
    return [*comment_lines(comment, " " * indent), text]


def comment_lines(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")


def method_values(method: str, dataset: str) -> dict[str, Any]:
    """The options a file sets, in order (method_params last): the setting's and the resolved recipe's."""
    from unison.config import TrainConfig
    from unison.data.augment import PRESETS
    from unison.methods import METHODS
    from unison.training.resolve import resolve_recipe

    setting, cls = SETTINGS[dataset], METHODS[method]
    distill = bool(getattr(cls, "needs_teacher", False))
    vit = cls.recipe.backbone.startswith("vit_")
    backbone = setting.distill_student if distill else setting.vit if vit else setting.cnn
    recipe = resolve_recipe(TrainConfig(method=method, data=setting.data, backbone=backbone,
                                        image_size=setting.image_size))
    values: dict[str, Any] = {"method": method, "data": setting.data, "val": setting.val,
                              "image_size": setting.image_size, "backbone": recipe.backbone}
    if distill:
        values["teacher"] = setting.distill_teacher
    values.update(epochs=setting.epochs, batch_size=setting.batch_size, warmup_epochs=setting.warmup_epochs,
                  optimizer=recipe.optimizer, lr=recipe.lr, weight_decay=recipe.weight_decay)
    if recipe.optimizer in ("sgd", "lars"):
        values["momentum"] = TrainConfig().momentum
    values["augmentation"] = recipe.augmentation
    n_local = PRESETS[recipe.augmentation]["n_local"]
    if n_local:
        values["local_crops"] = n_local if recipe.local_crops is None else recipe.local_crops
        if recipe.local_crop_size is not None:
            values["local_crop_size"] = recipe.local_crop_size
    for key, value, _ in setting.extra:
        values[key] = value
    values.update(eval_every=setting.eval_every, out=f"runs/{method}_{dataset}")
    values["method_params"] = dataclasses.asdict(cls.Params())
    return values


def summary_of(cls: type) -> str:
    """The first line of the method's module docstring: its name, paper and idea."""
    doc = inspect.getmodule(cls).__doc__ or cls.__name__
    return doc.strip().splitlines()[0].replace("``", "")


def render(method: str, dataset: str) -> str:
    from unison.methods import METHODS

    setting, cls = SETTINGS[dataset], METHODS[method]
    values = method_values(method, dataset)
    module = inspect.getmodule(cls).__name__
    source_file = module.replace(".", "/") + ".py"
    name = f"{method}_{dataset}.yaml"
    peak = values["lr"] * values["batch_size"] / 256
    comments = {
        "data": setting.data_comment, "val": "labelled held-out images for kNN (any layout data takes)",
        "image_size": "training crop size in pixels",
        "backbone": setting.backbone_note.get(values["backbone"], ""),
        "teacher": "a unison run to distil (train it first with its own file), or a weights file with "
                   "teacher_backbone: NAME",
        "epochs": setting.source.split(" (")[0], "batch_size": "GLOBAL batch, split evenly over the workers",
        "warmup_epochs": "linear warm-up, then cosine decay to 0",
        "optimizer": "the recipe's", "lr": f"per 256 images, scaled linearly: peak {peak:.6g} at batch "
                                           f"{values['batch_size']}",
        "weight_decay": "the recipe's", "momentum": "SGD/LARS momentum (unison's default)",
        "augmentation": "the recipe's preset (unison train --help lists them)",
        "local_crops": "local crops besides the 2 global views" + (" (none at 32 px and below: the recipe's)"
                                                                  if values.get("local_crops") == 0 else ""),
        "local_crop_size": "their side: 3/7 of the image size" + (", a multiple of the patch" if "vit" in values["backbone"] else ""),
        "eval_every": "kNN on val every N epochs, and at the end", "out": "the run directory",
    }
    extra = {key: comment for key, _, comment in setting.extra}
    data_note = ("`cifar10` needs no path: torchvision downloads it on first use." if setting.data == "cifar10"
                 else f"{setting.data} and {setting.val} are placeholders: give your folders here or as flags "
                      "(--data DIR --val DIR).")
    paragraphs = [
        f"Source. Optimizer, lr, weight decay, augmentation and method_params: unison's recipe for {method} "
        f"({cls.__name__}.recipe and {cls.Params.__name__} in src/{source_file}, whose comments name each value's "
        f"origin): the values a run takes when these keys are left out. Epochs, batch and warm-up: {setting.source}.",
        f"Data: {data_note} Workers: one per visible GPU (2 processes on a CPU); --world-size N, or "
        "distributed: {world_size: N} here.",
        "Generated by scripts/write_configs.py from the recipe: edit a copy, or change the recipe and run the "
        "script again.",
    ]
    head = [*comment_lines(summary_of(cls)), f"# On {setting.title}:", f"#     unison train --config examples/configs/{name}",
            *comment_lines("Flags after it override the file (--epochs 50, --data DIR, --world-size 4). Any option "
                           "of `unison train --help` goes here by its field name (batch_size, not --batch-size), the "
                           "method's hyper-parameters (--param NAME=VALUE) under method_params:, the distributed "
                           "options under distributed:.")]
    for paragraph in paragraphs:
        head += ["#", *comment_lines(paragraph)]
    body = [""]
    for key, value in values.items():
        if key != "method_params":
            body += line(key, value, comments.get(key) or extra.get(key, ""))
    body += ["", "method_params:                           # every hyper-parameter of the method, at its default"]
    for key, value in values["method_params"].items():
        body += line(key, value, indent=2)
    return "\n".join(head + body) + "\n"


def guide_table(guide: str) -> str:
    """`guide` (the methods guide's text) with its table of the files, between `TABLE_START` and `TABLE_END`, as
    this script writes it: three methods a row, a link to each of its files."""
    from unison.methods import METHODS

    if TABLE_START not in guide or TABLE_END not in guide:
        raise SystemExit(f"write_configs: {GUIDE.relative_to(ROOT)} lost its lines {TABLE_START} and {TABLE_END}")
    link = f"../../{CONFIG_DIR.relative_to(ROOT).as_posix()}"
    cells = [f"`{m}` | " + " · ".join(f"[{s.short}]({link}/{m}_{d}.yaml)" for d, s in SETTINGS.items())
             for m in sorted(METHODS)]
    per_row = 3   # three methods a row: the table stays short enough to read beside the guide's steps
    rows = ["| " + " | ".join(["`--method` | files"] * per_row) + " |", "|" + "---|---|" * per_row]
    for first in range(0, len(cells), per_row):
        row = cells[first:first + per_row]
        rows.append("| " + " | ".join(row + [" | "] * (per_row - len(row))) + " |")
    before, rest = guide.split(TABLE_START, 1)
    return before + TABLE_START + "\n" + "\n".join(rows) + "\n" + TABLE_END + rest.split(TABLE_END, 1)[1]


def expected_files() -> dict[Path, str]:
    """Every file this script writes, with its text: two per method in `unison.methods.METHODS`, and the methods
    guide with its table of them."""
    from unison.methods import METHODS

    files = {CONFIG_DIR / f"{method}_{dataset}.yaml": render(method, dataset)
             for method in sorted(METHODS) for dataset in SETTINGS}
    files[GUIDE] = guide_table(GUIDE.read_text())
    return files


def stale_files() -> list[str]:
    """The files that are missing or differ from what this script writes now (relative to the repository)."""
    return [str(path.relative_to(ROOT)) for path, text in expected_files().items()
            if not path.is_file() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which files are missing or differ")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"write_configs: {path} is missing or out of date", file=sys.stderr)
        if stale:
            print("write_configs: run python scripts/write_configs.py", file=sys.stderr)
        return 1 if stale else 0
    files = expected_files()
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    written = 0
    for path, text in files.items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written += 1
    known = set(files)
    for path in sorted(CONFIG_DIR.glob("*.yaml")):  # a method that went: its files are left for a person to delete
        if path not in known:
            print(f"write_configs: {path.relative_to(ROOT)} is no method's file any more: delete it if so",
                  file=sys.stderr)
    print(f"write_configs: {written} of {len(files)} files written ({CONFIG_DIR.relative_to(ROOT)}, "
          f"{GUIDE.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
