"""Helpers shared by the unit and distributed tests of test_checkpoint."""

from __future__ import annotations

from pathlib import Path


def _temporaries(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
