"""The distributed primitives: process groups and launch (`env`, `launch`, `signals`, `watchdog`), collectives
(`collectives`, `dtensor`), rank-local tagging (`tagging`), synchronised batch norm (`sync_batchnorm`) and
communication metering (`comm_meter`). The wiring of whole models (DDP, FSDP2, ZeRO-1) is `unison.parallel`,
one layer up; the options are `unison.config.DistributedConfig`, one layer down."""

from unison.config.distributed import DistributedConfig  # where the README's snippets and users look for it

__all__ = ["DistributedConfig"]
