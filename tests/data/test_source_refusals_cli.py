"""Hostile data sources through ``unison train``: one ``unison: error:`` line, exit code 3, before any worker
(or, for the strips, found by the in-process worker while it builds the data).

The pre-flight (`open_checked`) finds each of these in the launching process, so no worker process
starts (the cases run in well under a second each). The in-process cases of each rule are
tests/data/test_source_refusals.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from unison.cli import main

ARGS = ["--world-size", "1", "--max-steps", "1", "--batch-size", "4", "--no-progress"]


def _png(path: Path, value: int = 0) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, 255 - value, value // 2)).save(path)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    for c in ("a", "b"):
        for i in range(4):
            _png(tmp / "fifo" / c / f"{i:03d}.png", 30 * i)
    os.mkfifo(tmp / "fifo" / "a" / "000x.png")
    for i in range(4):
        _png(tmp / "mixed" / f"{i}.png", 30 * i)
        _png(tmp / "mixed" / "thumbs" / f"{i}.png", 30 * i)
    from PIL import Image

    for c in ("a", "b"):   # 4000 x 1 strips: the default view size was the long side (4000 x 4000 views, 32 GB)
        for i in range(4):
            (tmp / "strips" / c).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (4000, 1), (30 * i, 0, 0)).save(tmp / "strips" / c / f"{i}.png")
    for split in ("train", "val"):   # the parent of the splits, given as --data
        for c in ("a", "b"):
            _png(tmp / "splits" / split / c / "0.png")
    (tmp / "labels.txt").write_text("".join(f"mixed/{i}.png {10_000_000 if i == 3 else 0}\n" for i in range(4)))
    return tmp


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


@pytest.mark.parametrize("case, argv, fragment", [
    ("empty-data", ["--data", ""], "--data '' is not a path; give a folder, a file list"),
    ("empty-val", ["--val", ""], "--val '' is not a path"),
    ("fifo-image", ["--data", "{tmp}/fifo"], "000x.png is a FIFO (named pipe), not an image file"),
    ("images-beside-subfolder", ["--data", "{tmp}/mixed"],
     "holds both images (0.png, 1.png, 2.png and 1 more) and subfolders (thumbs)"),
    ("list-label-1e7", ["--data", "{tmp}/labels.txt"], "line 4: label 10000000 is past the largest class index"),
    ("strip-images-memory", ["--data", "{tmp}/strips"], "are 4000x1 px (the 8 images read), too small a side for a "
                                                         "default view size; give --image-size N (at least 8)"),
    ("val-is-the-data", ["--data", "{tmp}/mixed/thumbs", "--val", "{tmp}/mixed/thumbs"],
     "is the training data (--data"),
    ("val-inside-the-data", ["--data", "{tmp}/strips", "--val", "{tmp}/strips/b"], "overlaps the training data"),
    ("strip-images-stream", ["--data", "{tmp}/strips", "--data-mode", "stream"], "are 4000x1 px"),
    ("parent-of-the-splits", ["--data", "{tmp}/splits"], "/splits holds the splits train/ and val/, not class "
                                                         "folders: give --data "),
])
def test_bad_data_ends_in_one_line_and_exit_3(hostile, tmp_path, capfd, case, argv, fragment):
    argv = [a.replace("{tmp}", str(hostile)) for a in argv]
    box: dict = {}
    capfd.readouterr()
    t = threading.Thread(target=lambda: box.update(code=main(["train", *ARGS, *argv, "--out", str(tmp_path / "r")])),
                         daemon=True)
    t.start()
    t.join(60)                                   # the FIFO hung the old code: fail, do not hang
    assert not t.is_alive(), f"{case}: still running after 60 s"
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert box.get("code") == 3 and len(errors) == 1 and fragment in errors[0], err
    assert "Traceback" not in err
