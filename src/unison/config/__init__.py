"""Configuration: plain dataclasses with the one set of defaults, and their own field checks.

The bottom layer with `unison.errors`: nothing here imports anything else of unison. Names that only the layers
above know (methods, backbones, augmentation presets) are checked where they are resolved,
`unison.training.resolve`.

* `train`: `TrainConfig`, everything a run needs;
* `distributed`: `DistributedConfig`, the process-group options;
* `fields`: coercion of numbers as recipes write them, "did you mean", and argparse options generated from the
  dataclasses (the CLI is built from them).
* `files`: configuration files and values read as bounded regular UTF-8 files by a strict YAML loader (no
  aliases, string keys given once).
"""

from .distributed import DistributedConfig
from .train import TrainConfig

__all__ = ["DistributedConfig", "TrainConfig"]
