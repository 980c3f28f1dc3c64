"""Training: the step (`step.py`), the loop around it (`loop.py`), checkpoints, metrics, summary.

``unison.train`` is both this package and the API function ``unison.train(cfg) -> Summary``:
importing any ``unison.train.*`` module binds the name ``train`` on the ``unison`` package to
this package, so the package itself is callable and forwards to `unison.api.train`.
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, cfg: Any, **options: Any) -> Any:
        from unison.api import train

        return train(cfg, **options)


sys.modules[__name__].__class__ = _CallableModule
