"""The distributed engine: configuration, process groups, launch, collectives, SyncBN, DDP wiring, optimizers."""

from .config import ConfigError, DistributedConfig

__all__ = ["ConfigError", "DistributedConfig"]
