"""The files a training run writes beside its checkpoints (rank 0): ``config.json``, ``metrics.csv``,
``summary.json`` and ``plot.png``.

A write of one of them that fails (a full disk, a quota, a read-only or failing file system) ends the run as a
failed checkpoint save does (`unison.training.checkpoint.files.write_failure_message`): exit 4 (`CheckpointError`)
and one line that names the file and the last good checkpoint, which is intact, not an ``OSError`` traceback. At
the end of the run that checkpoint holds the run's last step, so ``--resume auto``, once there is room, goes
straight to the end and writes these files again.
"""

from __future__ import annotations

import errno
from pathlib import Path

from unison.errors import CheckpointError
from unison.training.checkpoint import latest_checkpoint


def run_file_error(path: str | Path, e: OSError, run_dir: str | Path) -> CheckpointError:
    """The one line for run file `path` that could not be written (`e`), naming the last good checkpoint."""
    last = latest_checkpoint(Path(run_dir))
    kept = f"the last good checkpoint is {last} (intact)" if last is not None else "there is no checkpoint yet"
    then = "continue with --resume auto" if last is not None else "start again"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return CheckpointError(f"{what}: could not write {path}; {kept}; free space, then {then}")
    if e.errno == errno.EROFS:
        return CheckpointError(f"read-only file system: could not write {path}; {kept}")
    reason = e.strerror or (errno.errorcode.get(e.errno, "") if e.errno else "") or str(e)
    return CheckpointError(f"could not write {path} ({reason}); {kept}")

