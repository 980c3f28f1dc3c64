"""Helpers of tests/training/test_checkpoint.py, for its in-process tests and those that start processes."""

from __future__ import annotations

from pathlib import Path


def _temporaries(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
