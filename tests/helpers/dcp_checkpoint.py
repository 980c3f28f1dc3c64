"""Helpers shared by the unit and distributed tests of test_dcp_checkpoint."""

from __future__ import annotations

import os
from pathlib import Path


# ------------------------------------------------------------------ loading never runs pickled code
class _Payload:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))
