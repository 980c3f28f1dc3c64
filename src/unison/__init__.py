"""unison: self-supervised pre-training of image encoders, exact on any number of workers.

Training on W workers with a batch of B/W images each is mathematically the same as one worker with the batch of
B, for every method (SimCLR, MoCo, BYOL, DINO, MAE, ...). The functions below do what the `unison` commands do,
with keyword arguments for the command's options:

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="moco", epochs=10))   # unison train --method moco --epochs 10
    print(summary.result_line())
    assert unison.check("byol", world_size=2).passed                # 2 workers == 1 worker on the global batch
    scores = unison.evaluate("runs/default")                        # kNN and linear-probe top-1
    features = unison.embed("runs/default", "photos/")["features"]  # one row per image, in input order
    unison.export("runs/default", "backbone.pt")                    # loads into torchvision without unison
    net = unison.load_backbone("runs/default")                      # the trained encoder, an nn.Module

``help(unison.train)`` (and ``check``, ``evaluate``, ``embed``, ``export``, ``load_backbone``) shows a function's
arguments and an example. A bad argument or a failed run raises a ``unison.errors`` exception whose message is one
line saying what to fix. The command line: ``unison --help``.
"""

import sys
import types
from typing import Any

from unison.version import __version__

API = ("check", "embed", "evaluate", "export", "load_backbone", "train")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        from unison import api

        return getattr(api, name)
    raise AttributeError(f"module 'unison' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*API, "__version__"})


class _Package(types.ModuleType):
    """The package's module: a submodule named like an API function does not replace the function."""

    # Importing a submodule sets the package's attribute of that name (``import unison.export`` would make
    # ``unison.export`` the module, not the function); this declines that for the API's names. The module stays
    # ``sys.modules["unison.export"]``, which ``from unison.export import ...`` reads.

    def __setattr__(self, name: str, value: Any) -> None:
        if name in API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
