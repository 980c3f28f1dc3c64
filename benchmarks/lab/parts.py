"""The lab's two parts of `unison bench`: what ``lightly`` and ``race`` measure, the options they read, the files
they write, and how `unison.bench.commands` checks, plans and runs them.

`unison.bench.commands` is the one ``unison bench`` command: it builds every part's options and runs the parts in
turn, and for these two it calls this module (found by `unison.bench.lab`). Nothing here imports torch or Lightly
until a part runs, so ``unison bench lightly --help`` answers at once, and without Lightly SSL `check` stops
``bench lightly`` with the hint to install it.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from unison.bench import report
from unison.bench.commands import COMMON_OPTIONS, DATA_OPTIONS
from unison.config.extras import install_command
from unison.errors import ConfigError

from .config import LabConfig

PARTS = ("lightly", "race")
WHAT = {
    "lightly": "Each --method (seed: Lightly's six; all: also vicreg, dino, mae, nnclr, dcl, dclw, tico, fastsiam, mmcr, "
               "wmse, smog, empssl, vicregl, densecl, msn, pmsn, simmim, aim, capi) with "
               "the same backbone type, data, global batch, steps and schedule, each side its own recipe (Lightly's: "
               "its modules, transforms and CIFAR-10 settings); one training process per side (Lightly's with its "
               "DataLoader workers); kNN of both encoders by the same code, throughput and peak memory.",
    "race": "SimCLR, same backbone type, images and global batch: unison (`--preset speedrun --time-budget`) and "
            "Lightly's documented pipeline with its CIFAR-10 hyper-parameters, one after the other, the same budget "
            "each (setup included); every snapshot scored by the same kNN code on the val images afterwards.",
}
# The options each part reads (the others keep the preset's value)
OPTIONS = {
    "lightly": (*COMMON_OPTIONS, *DATA_OPTIONS, "method", "seeds", "epochs", "batch_size", "backend", "train_args",
                "lightly_steps", "lightly_epochs", "lightly_eval_every", "lightly_loader_workers", "lightly_threads", "peak_tflops"),
    "race": (*COMMON_OPTIONS, "data", "val", "race_subset", "race_val_subset", "knn_k", "batch_size", "budget",
             "race_points", "lightly_loader_workers", "lightly_threads", "train_args"),
}
RESULT_FILES = {"lightly": ("md", "csv"), "race": ("md", "csv", "png", "json")}   # written into --out
LIGHTLY_EXTRA = install_command("bench")
# said in the help of both parts and of `bench all`, which runs the Lightly comparison
NEEDS_LIGHTLY = (f" The Lightly side needs Lightly SSL ({LIGHTLY_EXTRA}); without it `bench lightly` stops with that "
                 "hint and `bench all` reports the side as not measured.")


def result_paths(out_dir: Path, part: str) -> dict[str, Path]:
    """The result files of `part` in `out_dir`, by kind: ``{"md": out_dir / "lightly.md", ...}``."""
    return report.result_paths(out_dir, part, RESULT_FILES[part])


def check(parts: list[str]) -> None:
    """`bench lightly` without Lightly SSL installed stops with the install hint; `bench all` says so up front."""
    from .lightly_compare import lightly_available

    if "race" in parts:
        parts = ["lightly"]   # the race needs the Lightly side: stop with the hint
    if "lightly" not in parts:
        return
    why_not = lightly_available()
    if why_not is None:
        return
    if parts == ["lightly"]:
        raise ConfigError(f"bench lightly needs Lightly SSL, which does not import ({why_not})")
    print(f"unison bench: warning: Lightly SSL does not import ({why_not}); the Lightly side will be reported "
          "as not measured", file=sys.stderr, flush=True)


def run(part: str, cfg: LabConfig, train: str, val: str | None, out: Path, header: Callable[[str], str],
        start_load: str) -> str:
    """Measure `part` and write its files; its markdown section, under `header(the load note)`."""
    if part == "race":
        from .race import race, write_race

        result = race(cfg, train, val, out)
        return write_race(result, out, header("before each side and after: the Load column"))["md"].read_text()
    from .lightly_compare import compare, write_lightly

    rows = compare(cfg, train, val, out)
    return write_lightly(rows, out, header(f"at start {start_load}; just before each run: the Load "
                                           "column"))["md"].read_text()


def train_argvs(part: str, cfg: LabConfig, train: str, val: str | None, out: Path) -> list[list[str]]:
    """The ``unison train`` arguments of unison's side of every run of `part`."""
    from .lightly_compare import for_method, side_run_name, side_threads, unison_side_argv

    if part == "race":
        from .race import unison_argv

        return [unison_argv(cfg, train, out / "runs" / "race-unison", side_threads(cfg))]
    seeded = [(m, dataclasses.replace(cfg, seed=seed)) for m in cfg.lightly_method_list for seed in cfg.seed_list]
    return [unison_side_argv(for_method(c, m), m, train, val, out / "runs" / side_run_name(c, m)) for m, c in seeded]


def print_plan(part: str, cfg: LabConfig, argvs: list[list[str]]) -> None:
    """The dry run of `part`: unison's commands (`train_argvs`) and what Lightly's side would do."""
    if part == "race":
        print("unison " + shlex.join(argvs[0]))
        print(f"# + Lightly SSL side: SimCLRTransform + DataLoader({cfg.lightly_loader_workers} workers), "
              f"budget {cfg.budget}; then kNN of {cfg.race_points} + 1 snapshots per side")
        return
    for argv, method in zip(argvs, (m for m in cfg.lightly_method_list for _ in cfg.seed_list)):
        print("unison " + shlex.join(argv))
        print(f"# + Lightly SSL side of {method}: its transform, heads and loss + DataLoader("
              f"{cfg.lightly_loader_workers} workers), " + (
                  f"{cfg.lightly_epochs} epochs of batch {cfg.batch_size} (unison's side's steps)"
                  + (f", kNN every {cfg.lightly_eval_every} epochs" if cfg.lightly_eval_every else "")
                  if cfg.lightly_epochs else f"{cfg.lightly_steps} steps of {cfg.batch_size}"))
