"""``--preset NAME``: a named recipe that fills the options a run does not give (flags, YAML and the resumed run's
configuration win over it).

``speedrun``: the best encoder a fixed wall-clock time buys on CIFAR-sized data (32 px, up to a few hundred
thousand images), with ``--time-budget 5m`` unless one is given.

* data decoded once and resident as uint8 on the device (``--data-mode memory``), views made there by the batched
  augmentation (`unison.data.augment.ViewAugmenter`), kNN sets on the device;
* channels_last (the default, on a CPU too); on a GPU bf16 autocast, on a CPU none (CPU autocast does not pay for
  the small models a CPU trains);
* ``--compile`` on a CPU where a C++ compiler and Python's headers are found (inductor needs both): there the
  faster step repays its compile time within a short budget. Not on a GPU: there the compile time is a large
  share of a short budget and the eager ResNet-18 step is no slower; give ``--compile`` to try it on your card
  (docs/benchmarks.md has both measurements);
* SGD runs torch's multi-tensor (foreach) step on a GPU; the step's host synchronisations are the ones
  ``unison plan`` lists (the finite-loss check);
* everything that spends the budget on something other than steps is off: the random-initialisation kNN, the
  label-free signals, the online probe (the final kNN is kept; on a GPU against every training image, the
  protocol of published kNN figures, so the result compares with them);
* a checkpoint a minute of training, not one per epoch: a GPU trains a CIFAR-10 epoch in seconds, and each save
  pauses the step loop while it copies the state, so saving every epoch would spend the budget on saves.

Hyper-parameters. Shared: SimCLR, SGD with momentum 0.9, weight decay 5e-4, one epoch of warm-up (at most a tenth
of a budgeted run's steps), as Lightly's CIFAR-10 benchmark; NT-Xent temperature 0.2, learning rate 0.45 per 256
images, crops from 20 % of the image (the ``mocov2`` augmentation: SimCLR's colour jitter, MoCo v2's crops)
instead of Lightly's 0.5, 0.12 and 8 %. Chosen on the CIFAR-10 ``val`` split only, at the preset's
own budget with the small CNN and in a many-epoch proxy of a GPU's regime; docs/benchmarks.md ("How the speed-run
recipe was chosen") has every run, its command and its result.

* On a GPU (`SPEEDRUN_GPU`): a ResNet-18 (CIFAR stem) at batch 512 (lr 0.9), the values above.
* On a CPU (`SPEEDRUN_CPU`): the small CNN at batch 256. Not a ResNet-18: a CPU's ResNet-18 step and start-up
  are so slow that a 5-minute budget would train a handful of steps.

The method parameters (the temperature) are SimCLR's: with another ``--method`` they are left out, and one warning
says which (`with_preset`); the other values apply to any method.

To tune them further, vary one at a time on the ``val`` split only (``--val <val> --time-budget 5m``), never on a
test set.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import warnings
from pathlib import Path
from typing import Any

from unison.errors import ConfigError

# lr, augmentation and temperature chosen on the val split on a CPU (the module docstring)
SPEEDRUN: dict[str, Any] = {
    "method": "simclr", "data_mode": "memory", "optimizer": "sgd", "weight_decay": 5e-4, "warmup_epochs": 1.0,
    "lr": 0.45, "augmentation": "mocov2", "method_params": {"temperature": 0.2},
    "time_budget": "5m", "random_init_knn": False, "signal_images": 0, "online_probe": False,
    "checkpoint_every": "1m",
}
# knn_reference 0: every training image, as published kNN figures use (cheap on a GPU, not on a CPU)
SPEEDRUN_GPU: dict[str, Any] = {"backbone": "resnet18", "batch_size": 512, "amp": "bf16", "knn_reference": 0}
SPEEDRUN_CPU: dict[str, Any] = {"backbone": "small_cnn", "batch_size": 256}
PRESETS = ("speedrun",)


def cpu_compiler_found() -> bool:
    """Whether torch.compile can build CPU kernels here: its inductor compiles C++ (``$CXX``, else g++, c++ or
    clang++) that includes Python's headers (``Python.h``, e.g. Debian's python3-dev)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    return any(shutil.which(name) for name in names) and headers.is_file()


def preset_values(name: str, cuda: bool) -> dict[str, Any]:
    """The options preset `name` sets on a machine with (`cuda`) or without a GPU."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r:.40} is unknown; use one of {', '.join(PRESETS)}")
    if cuda:
        return {**SPEEDRUN, **SPEEDRUN_GPU}
    return {**SPEEDRUN, **SPEEDRUN_CPU, **({"compile": True} if cpu_compiler_found() else {})}


def with_preset(given: dict[str, Any], cuda: bool, say: bool = True) -> dict[str, Any]:
    """`given` (a configuration's explicit options) on top of its ``preset``'s values; nested mappings
    (method_params, distributed) merge key by key. ``epochs`` given without ``time_budget`` sets the run's length:
    the preset's time budget is then left out (``--preset speedrun --epochs 200`` trains 200 epochs). The preset's
    method parameters are its method's (SimCLR's temperature): with another ``method`` given they are left out,
    and (`say`) one warning names them."""
    name = given.get("preset")
    if name is None:
        return given
    merged = dict(preset_values(name, cuda))
    if "epochs" in given and "time_budget" not in given:   # the length given in epochs: not the preset's time
        merged.pop("time_budget", None)
    method = given.get("method", merged["method"])
    if method != merged["method"]:   # another method's parameters: BYOL has no temperature
        left_out = merged.pop("method_params", {})
        if say and left_out:
            values = ", ".join(f"{k}={v!r}" for k, v in left_out.items())
            warnings.warn(f"--preset {name}'s {merged['method']} parameter(s) {values} are not applied to --method "
                          f"{str(method)[:40]}; give that method's own with --param NAME=VALUE", stacklevel=3)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
