"""The files a run writes beside its checkpoints (config.json, metrics.csv, summary.json, plot.png): a write that meets
a full disk (ENOSPC raised where each is written) ends the run as a failed checkpoint save does, with exit 4 and one
line that names the file and the last good checkpoint, and leaves no half-written file; with room again, the same
command with --resume auto writes them. Runs of two steps at world size 1, in this process."""

from __future__ import annotations

import builtins
import csv
import errno
import json
import os
from pathlib import Path

import pytest
from fault_helpers import run_cli

from unison import paths
from unison.training.metrics import MetricsLogger

W1 = ["--world-size", "1", "--no-progress", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k",
      "5", "--signal-images", "0", "--no-random-init-knn", "--max-steps", "2"]


def _full_disk_at(name: str, monkeypatch) -> None:
    """ENOSPC where run file `name` is written (what a write that ran out of space raises)."""
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if name == "plot.png":
        from matplotlib.figure import Figure

        def savefig(self, fname, **kwargs):
            Path(fname).write_bytes(b"")   # what a write that ran out of space leaves
            raise enospc

        monkeypatch.setattr(Figure, "savefig", savefig)
    else:   # summary.json: written through its temporary sibling (`unison.paths.write_text_atomic`)
        def full_open(file, *args, **kwargs):
            if f".{name}." in str(file):
                raise enospc
            return builtins.open(file, *args, **kwargs)

        monkeypatch.setattr(paths, "open", full_open, raising=False)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name, budget", [("plot.png", ["--time-budget", "1h"]), ("summary.json", [])])
def test_a_full_disk_at_the_end_of_a_run_is_one_line_naming_the_last_checkpoint(name, budget, tmp_path, capfd,
                                                                                monkeypatch):
    """Was a 74-line traceback and exit 1 for plot.png at the end of a budgeted run."""
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    out = tmp_path / "run"
    argv = ["train", *W1, *budget, "--out", str(out)]
    with monkeypatch.context() as m:
        _full_disk_at(name, m)
        code, err = run_cli(argv, capfd)
    errors = [line for line in err.splitlines() if line.startswith("unison: error:")]
    last = out / "checkpoints" / "step_00000002.pt"
    assert code == 4 and errors == [f"unison: error: no space left on device: could not write {out / name}; the last "
                                    f"good checkpoint is {last} (intact); free space, then continue with --resume "
                                    "auto"], err
    assert not (out / name).exists() and not list(out.glob(f".{name}*"))
    code, err = run_cli([*argv, "--resume", "auto"], capfd)   # room again: the run's end is written
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_a_full_disk_under_the_metrics_is_the_runs_one_line(tmp_path):
    """A row written, and the file closed, onto a full disk: the error the run gave the logger, not an OSError."""
    logger = MetricsLogger(tmp_path, error=lambda path, e: RuntimeError(f"{path.name}: {e.strerror}"))
    logger._file.close()

    class Full:
        closed = False

        def write(self, *args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        flush = close = write

    logger._file = Full()
    logger._writer = csv.DictWriter(logger._file, fieldnames=["step"], extrasaction="ignore")
    for write in (lambda: logger.log(step=1), logger.close):
        with pytest.raises(RuntimeError, match=r"^metrics.csv: No space left on device$"):
            write()
    logger.release()   # a failed run's release says nothing more
