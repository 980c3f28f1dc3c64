"""``unison train``'s outputs, in this process at world size 1: a resume never overwrites later checkpoints (of
its own run or of another one), the run directory is never the data, and a run directory on a full disk is one
line before anything starts. The export/eval cases and the rules themselves are tests/unit/cli/test_outputs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import full_tmpfs

from unison.cli import main

W1 = ["--world-size", "1", "--batch-size", "8", "--max-steps", "2", "--no-random-init-knn", "--no-progress",
      "--subset", "64", "--val-subset", "16", "--knn-k", "5"]


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("outputs") / "run"
    assert main(["train", *W1, "--checkpoint-every", "1", "--out", str(run)]) == 0
    return run


def _train(argv: list[str], capfd) -> tuple[int, str]:
    capfd.readouterr()
    code = main(["train", *argv])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


TRAIN_CASES = [
    ("resume-early-checkpoint-into-its-run", ["--resume", "{run}/checkpoints/step_00000001.pt", "--max-steps", "4"],
     "--resume {run}/checkpoints/step_00000001.pt is step 1 of the run in {run}, whose latest checkpoint is "
     "step_00000002.pt: resuming into {run} would overwrite its later checkpoints; pass a new --out DIR to branch "
     "from step 1, or --resume {run} to continue its latest"),
    ("resume-into-a-run-with-later-checkpoints", ["--resume", "{tmp}/early.pt", "--max-steps", "4", "--out", "{run}"],
     "--out {run} holds checkpoints up to step_00000002.pt, later than --resume {tmp}/early.pt (step 1)"),
    ("out-is-a-runs-checkpoints-folder", ["--out", "{run}/checkpoints"],
     "--out {run}/checkpoints is the checkpoints folder of the run in {run}; give a run directory: a new one, or "
     "--resume {run} to continue that run"),
    ("out-is-the-data-folder", ["--data", "{tmp}/images", "--subset", "8", "--val-subset", "8", "--out", "{tmp}/images"],
     "--out {tmp}/images lies inside --data {tmp}/images, which this run reads; choose a run directory outside "
     "the data"),
    ("out-is-empty", ["--out", ""], "--out is empty; give a run directory, e.g. --out runs/x"),
    ("out-inside-a-class-folder-reached-through-a-link",
     ["--data", "{tmp}/links", "--subset", "8", "--val-subset", "8", "--out", "{tmp}/links/a/run"],
     "--out {tmp}/links/a/run lies inside --data {tmp}/links (its class folder a is a link to {tmp}/images/class_0), "
     "which this run reads"),
    ("out-inside-a-val-class-folder-reached-through-a-link", ["--val", "{tmp}/links", "--out", "{tmp}/links/b/run"],
     "--out {tmp}/links/b/run lies inside --val {tmp}/links (its class folder b is a link to {tmp}/images/class_1), "
     "which this run reads"),
    ("out-is-the-resumed-checkpoint", ["--resume", "{tmp}/early.pt", "--out", "{tmp}/early.pt"],
     "--out {tmp}/early.pt is a file (the checkpoint --resume reads), not a run directory; give a folder for the "
     "run's files"),
]


@pytest.mark.parametrize("case_id, argv, fragment", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_never_overwrites_another_runs_files(case_id, argv, fragment, run, tmp_path, capfd, monkeypatch):
    from unison.data.generated import write_image_folder

    monkeypatch.chdir(tmp_path)   # where a run with --out '' wrote on the old code: never the checkout

    fill = {"run": str(run), "tmp": str(tmp_path)}
    (tmp_path / "early.pt").write_bytes((run / "checkpoints" / "step_00000001.pt").read_bytes())
    write_image_folder(tmp_path / "images", 16, classes=2, sizes=(16, 20), seed=0)
    (tmp_path / "links").mkdir()
    for name, target in (("a", "class_0"), ("b", "class_1")):   # class folders that are links to the data's
        (tmp_path / "links" / name).symlink_to(tmp_path / "images" / target)
    before, data_before = _files(run), _files(tmp_path / "images")
    code, line = _train([*W1, *[a.format(**fill) for a in argv]], capfd)
    assert code == 2 and fragment.format(**fill) in line, line
    assert _files(run) == before and _files(tmp_path / "images") == data_before


@pytest.mark.parametrize("how", ["fresh", "resume-auto", "resume-a-run", "current-folder"])
def test_a_folder_of_the_users_files_is_never_a_run_directory(how, run, tmp_path, capfd, monkeypatch):
    docs = tmp_path / "mydocs"
    docs.mkdir()
    for name in ("config.json", "summary.json", "metrics.csv"):
        (docs / name).write_text(f"the user's {name}\n")
    before = _files(docs)
    extra = {"fresh": [], "resume-auto": ["--resume", "auto"], "resume-a-run": ["--resume", str(run)],
             "current-folder": []}[how]
    out = str(docs)
    if how == "current-folder":
        monkeypatch.chdir(docs)
        out = "."
    code, line = _train([*W1, *extra, "--out", out], capfd)
    assert code == 2 and line == (f"unison: error: --out {out} already holds files that no unison run wrote "
                                  "('config.json', 'metrics.csv', 'summary.json'); a run writes its config.json, "
                                  "metrics.csv, plot.png, summary.json, train.log and checkpoints/ there and would "
                                  "replace them: choose a new or empty folder")
    assert _files(docs) == before and sorted(p.name for p in docs.iterdir()) == sorted(before)


def test_a_run_made_before_the_lock_existed_can_run_again(run, tmp_path, capfd):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_bytes((run / "config.json").read_bytes())   # no lock file, no checkpoints
    (old / "metrics.csv").write_text("step,loss\n")
    assert main(["train", *W1, "--out", str(old)]) == 0


def test_resume_branches_into_a_new_out_and_continues_its_latest(run, tmp_path, capfd):
    before = _files(run)
    assert main(["train", *W1, "--resume", f"{run}/checkpoints/step_00000001.pt", "--max-steps", "3",
                 "--checkpoint-every", "1", "--out", str(tmp_path / "branch")]) == 0
    assert (tmp_path / "branch" / "checkpoints" / "step_00000003.pt").is_file() and _files(run) == before


def test_run_directory_on_a_full_disk_is_one_line(tmp_path, capfd):
    with full_tmpfs(tmp_path / "fs") as fs:
        code, line = _train([*W1, "--out", str(fs / "run")], capfd)
        assert code == 2
        assert line == (f"unison: error: no space left on device: could not write {fs / 'run' / '.unison.lock'}; "
                        "free space or choose another --out")


@pytest.mark.parametrize("world", ["1", "2"])
def test_embed_onto_a_full_disk_is_one_line_naming_what_is_kept(run, world, tmp_path, capfd):
    """600 images' features (300 KB) onto a 64 KiB disk: was an OSError traceback (world size 1) or
    'worker rank 0 failed: OSError: [Errno 28]'; an earlier --out is left intact, no part is left behind."""
    from PIL import Image

    images = tmp_path / "images" / "a"
    images.mkdir(parents=True)
    for i in range(600):
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(images / f"{i:04d}.png")
    with full_tmpfs(tmp_path / "fs", fill=False) as fs:
        (fs / "e.npy").write_bytes(b"an earlier output")
        for out, extra, kept in ((fs / "new.npy", [], "no partial file is left"),
                                 (fs / "e.npy", ["--overwrite"], "the earlier e.npy is intact")):
            capfd.readouterr()
            code = main(["embed", "--checkpoint", str(run), "--data", str(images.parent), "--out", str(out),
                         "--world-size", world, "--batch-size", "64", *extra])
            err = capfd.readouterr().err
            lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
            assert lines[0].endswith(f"no space left on device: could not write {out}; {kept}; free space or choose "
                                     "another --out"), lines[0]
        assert sorted(p.name for p in fs.iterdir()) == ["e.npy"] and (fs / "e.npy").read_bytes() == b"an earlier output"
