"""`LabConfig`: `unison.bench.config.BenchConfig` plus the options of the peer comparisons, and their presets.

The lab's parts read every option of the bench (data, backbone, batch, load, ``--train-args``, ...) and these:
the Lightly comparison's methods, seeds, steps, loader workers, threads and the GPU's peak, and the race's budget,
evaluation points and subsets. Its presets are the bench's (`unison.bench.config.PRESETS`) with the Lightly side's
settings of each; a flag overrides one field of the chosen preset, as for every part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

from unison.bench import config as bench_config
from unison.bench.config import SEED_METHODS, BenchConfig, expand_methods
from unison.config.budget import parse_duration
from unison.errors import ConfigError

# with a Lightly side (`benchmarks.lab.lightly_methods`)
LIGHTLY_METHODS = (*SEED_METHODS, "vicreg", "dino", "mae", "nnclr", "dcl", "dclw", "tico", "fastsiam", "mmcr", "wmse",
                   "smog", "empssl", "vicregl", "densecl", "msn", "pmsn",
                   "simmim", "aim", "capi")


@dataclass
class LabConfig(BenchConfig):
    method: str = field(default="simclr", metadata={
        "help": "the Lightly comparison's method(s): a name, comma-separated names, 'seed' (the six of Lightly's "
                "table) or 'all' (every method with a Lightly side: the six, vicreg, dino, mae, nnclr, dcl, dclw, "
                "tico, fastsiam, mmcr, wmse, smog, empssl, vicregl, densecl, msn, pmsn, simmim, aim, capi)"})
    seeds: str = field(default="", metadata={
        "help": "the Lightly comparison: comma-separated seeds, each side run once per seed (e.g. 0,1: the spread of "
                "the two is the noise the kNN difference is judged against); default: --seed"})
    lightly_steps: int = field(default=200, metadata={
        "help": "optimiser steps of each side of the Lightly comparison (enough that each side's warm-up is under "
                "5 percent of its time, reported apart)"})
    lightly_epochs: int | None = field(default=None, metadata={
        "help": "the Lightly comparison by epochs: each side trains N epochs of the training images (instead of "
                "--lightly-steps) on one cosine schedule over them; with --lightly-eval-every, a kNN table by epoch"})
    lightly_eval_every: int = field(default=0, metadata={
        "help": "with --lightly-epochs: kNN of both sides every E epochs, and at the end (0: only at the end)"})
    lightly_loader_workers: int = field(default=2, metadata={
        "help": "DataLoader worker processes on the Lightly side (its docs use several)"})
    lightly_threads: int | None = field(default=None, metadata={
        "help": "torch threads of the training process on each side of the Lightly comparison (unset: all cores)"})
    peak_tflops: float | None = field(default=None, metadata={
        "help": "dense bf16 peak of the GPU in TFLOPS, for the fraction of peak in the Lightly comparison "
                "(default: the peak of the GPU's model, from a table of known GPUs)"})
    budget: str = field(default="15m", metadata={
        "help": "race: the wall-clock budget of each side (90s, 15m, 1h), setup included"})
    race_points: int = field(default=10, metadata={
        "help": "race: evaluation points per side (an encoder snapshot every budget / N seconds, and the last)"})
    race_subset: int | None = field(default=None, metadata={
        "help": "race: class-balanced subset of the training images (unset: all of them)"})
    race_val_subset: int | None = field(default=None, metadata={
        "help": "race: class-balanced subset of the val images (unset: all of them)"})

    def validate(self) -> LabConfig:
        super().validate()
        for m in self.lightly_method_list:
            if m not in LIGHTLY_METHODS:
                raise ConfigError(f"bench lightly: --method {m!r} has no Lightly side (Lightly ships CIFAR-10 pieces "
                                  f"for {', '.join(LIGHTLY_METHODS)}); use some of them, 'seed' or 'all'")
        if not self.lightly_method_list:
            raise ConfigError("bench lightly: --method is empty; give e.g. simclr, or seed")
        if not all(s.strip().isdigit() for s in self.seeds.split(",")) and self.seeds.strip():
            raise ConfigError(f"bench lightly: --seeds {self.seeds!r} must be seeds separated by commas, e.g. 0,1")
        if self.lightly_steps < 1:
            raise ConfigError(f"bench: lightly_steps={self.lightly_steps} must be >= 1")
        if self.lightly_epochs is not None and self.lightly_epochs < 1:
            raise ConfigError(f"bench lightly: --lightly-epochs {self.lightly_epochs} must be at least 1 epoch")
        if self.lightly_eval_every < 0:
            raise ConfigError(f"bench lightly: --lightly-eval-every {self.lightly_eval_every} must be >= 0 epochs "
                              "(0: only at the end)")
        if self.lightly_eval_every and self.lightly_epochs is None:
            raise ConfigError("bench lightly: --lightly-eval-every needs --lightly-epochs (the evaluations are every "
                              "E epochs of an N-epoch run); give both, e.g. --lightly-epochs 100 --lightly-eval-every 25")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"bench: --peak-tflops={self.peak_tflops} must be a positive number of TFLOPS")
        if self.race_points < 1:
            raise ConfigError(f"bench: race_points={self.race_points} must be >= 1")
        parse_duration(self.budget, "--budget")
        return self

    @property
    def lightly_method_list(self) -> list[str]:
        return expand_methods(self.method, {"seed": SEED_METHODS, "all": LIGHTLY_METHODS})

    @property
    def seed_list(self) -> list[int]:
        """--seeds, else --seed alone."""
        return list(dict.fromkeys(int(s) for s in self.seeds.split(",") if s.strip())) or [self.seed]

    def preset_defaults(self) -> LabConfig:
        return PRESETS[self.preset]


# The Lightly side's settings of each bench preset (the others are the dataclass defaults)
_LIGHTLY_SIDE: dict[str, dict[str, Any]] = {"gpu": {"lightly_steps": 200, "lightly_loader_workers": 8},
                                            "gpu1": {"lightly_steps": 200, "lightly_loader_workers": 8}}
PRESETS: dict[str, LabConfig] = {
    name: LabConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **_LIGHTLY_SIDE.get(name, {}))
    for name, base in bench_config.PRESETS.items()}


def config_from_overrides(overrides: dict[str, Any]) -> LabConfig:
    """The lab's preset named in `overrides` (default cpu), then every other given field on top."""
    return cast(LabConfig, bench_config.config_from_overrides(overrides, PRESETS))
