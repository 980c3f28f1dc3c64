"""Checks in the launching process of what would otherwise fail in every worker after start-up.

`preflight(cfg)` runs before any worker starts (`unison.train` calls it, after `TrainConfig.validate`,
which checks the method's hyper-parameters): data (folder, file list or shards: layout, image count
against subset and batch, by `unison.data.source.open_checked`, the function each worker's build
calls too), the checkpoint to resume (exists, intact, safe, same method: its header only, the weights are
read once, by the workers) and the run directory. Image decoding and model shapes are checked by the
workers, whose errors still reach the user as one line naming the rank.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from unison.config import TrainConfig
from unison.data.source import open_checked
from unison.distributed.env import restart_reason
from unison.errors import ConfigError
from unison.training.checkpoint import latest_checkpoint, read_header
from unison.training.runlog import append_run_log
from unison.training.step import data_spec


def preflight(cfg: TrainConfig, launched: bool) -> None:
    """Raise a one-line `ConfigError`/`DataError`/`CheckpointError` for what the workers would fail on."""
    spec = data_spec(cfg)
    for role in ("data", "val"):   # the rules every build applies (`open_checked`), before W workers start
        with warnings.catch_warnings():  # the workers repeat the scan and its warnings
            warnings.simplefilter("ignore")
            open_checked(spec, role)
    out = Path(cfg.out)
    if cfg.resume:  # missing, truncated, foreign, unsafe or other-method checkpoints fail here, not in W workers
        read_header(cfg.resume, expect_method=cfg.method)   # the header only: the worker loads the state, once
    elif not launched and restart_reason() is None and latest_checkpoint(out):
        warning = (f"unison: warning: {out} holds checkpoints of an earlier run, which this fresh run will replace; "
                   f"use --resume {out} (or --resume auto) to continue it")
        print(warning, file=sys.stderr)
        append_run_log(out, warning)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {out} ({e.strerror or e}); choose another --out") from None
