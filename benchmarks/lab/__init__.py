"""The lab: unison measured against its peers, ``unison bench lightly`` and ``unison bench race``.

Not part of the library (``src/unison``): these comparisons rebuild Lightly SSL's documented pipelines, one per
method, to measure unison against them, and follow Lightly's releases; a user's own training needs none of it.
They run from a clone of the repository: `unison.bench.commands` declares both parts with the options of
`LabConfig` and hands them to `parts` (found by `unison.bench.lab`, which puts the repository root on
``sys.path``: the side processes and ``unison train``'s workers import ``benchmarks.lab`` too). The numbers they
give are in docs/benchmarks.md, beside the command that reproduces each.

* `parts`: what each part measures, the options it reads, the files it writes; check, plan and run.
* `config`: `LabConfig` (the bench's options and the comparisons'), its presets, the methods with a Lightly side.
* `lightly_compare` and `lightly_report`: ``bench lightly``, each method side by side with Lightly SSL, and its
  report; `lightly_methods` (with `lightly_models`, `lightly_batch_models`, `lightly_dense` and
  `lightly_vit_models`): Lightly's side of each method, from Lightly's own modules.
* `race` and `race_hook`: ``bench race``, unison and Lightly's SimCLR on the same wall-clock budget.

Nothing here imports torch or Lightly until a part runs (``unison bench lightly --help`` answers at once); Lightly
is the ``bench`` extra.
"""

from . import config, parts
from .config import LabConfig

__all__ = ["LabConfig", "config", "parts"]
