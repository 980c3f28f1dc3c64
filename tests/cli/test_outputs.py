"""Every output path is checked against the inputs, the other outputs and what is already there (`unison.paths`):
``export --out`` and its sidecar, ``eval --json``, the run directory a resume writes into, its one owner.

In-process: the export/eval cases read a small checkpoint written here (no training); the run-directory rules are
called directly. The second part trains (and tests/cli/test_outputs_processes.py starts processes):

``unison train``'s outputs, in this process at world size 1: a resume never overwrites later checkpoints (of
its own run or of another one), the run directory is never the data, and a run directory on a full disk is one
line before anything starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fault_helpers import full_tmpfs

from unison.cli import main, make_parser
from unison.config import TrainConfig
from unison.errors import ConfigError, RunDirRefused
from unison.methods import get_method
from unison.models import build_backbone
from unison.paths import write_text_atomic
from unison.training.checkpoint import save_checkpoint
from unison.training.owner import LOCK_NAME, RunDirLock, check_run_dir
from unison.training.preflight import check_resume_target


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory with checkpoints at steps 1 and 2 (small CNN, SimCLR), plus its config.json."""
    torch.manual_seed(0)
    net, dim = build_backbone("small_cnn", None)
    cls = get_method("simclr")
    state = {"method": "simclr", "config": TrainConfig(backbone="small_cnn").to_dict(), "model": cls(net, dim, cls.Params()).state_dict()}
    run = tmp_path_factory.mktemp("outputs") / "run"
    for step in (1, 2):
        save_checkpoint(run, state, step=step)
    (run / "config.json").write_text('{"method": "simclr"}\n')
    return run


def _main(argv: list[str], capfd) -> tuple[int, str]:
    capfd.readouterr()
    code = main(argv)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert len(lines) == (1 if code else 0), err
    return code, lines[0] if lines else ""


def _snapshot(*paths: Path) -> dict[Path, bytes | None]:
    return {p: p.read_bytes() if p.is_file() else None for p in paths}


CKPT1 = "checkpoints/step_00000001.pt"


EXPORT_CASES = [
    ("export-out-is-its-sidecar", "{run}", "{tmp}/backbone.json", [],
     "--out {tmp}/backbone.json would be its own sidecar (the .json beside the weights"),
    ("export-out-is-the-checkpoint", "{run}/" + CKPT1, "{run}/" + CKPT1, ["--format", "pt"],
     "--out {run}/" + CKPT1 + " is {run}/" + CKPT1 + " (--checkpoint), which this command reads"),
    ("export-out-is-the-latest-checkpoint", "{run}", "{run}/checkpoints/step_00000002.pt", [],
     "lies inside {run}/checkpoints (the checkpoints of --checkpoint)"),
    ("export-out-in-the-checkpoint-folder", "{run}", "{run}/checkpoints/step_00000099.pt", [],
     "lies inside {run}/checkpoints (the checkpoints of --checkpoint)"),
    ("export-sidecar-is-the-run-config", "{run}", "{run}/config.pt", [],
     "the sidecar {run}/config.json of --out {run}/config.pt already exists; it is left as it is: pass --overwrite"),
    ("export-out-is-another-file", "{run}", "{tmp}/notes.pt", [],
     "--out {tmp}/notes.pt already exists; it is left as it is: pass --overwrite to replace it, or choose another"),
    ("export-out-is-the-checkpoint-even-with-overwrite", "{run}/" + CKPT1, "{run}/" + CKPT1, ["--overwrite"],
     "(--checkpoint), which this command reads"),
    ("export-out-is-a-directory", "{run}", "{tmp}", [], "is a directory; give a file name such as"),
]


@pytest.mark.parametrize("case_id, checkpoint, out, extra, fragment", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_export_never_replaces_what_is_not_its_own(case_id, checkpoint, out, extra, fragment, run, tmp_path, capfd):
    fill = {"run": str(run), "tmp": str(tmp_path)}
    (tmp_path / "notes.pt").write_bytes(b"my notes")
    before = _snapshot(*run.rglob("*"), tmp_path / "notes.pt", tmp_path / "backbone.json")
    code, line = _main(["export", "--checkpoint", checkpoint.format(**fill), "--out", out.format(**fill), *extra], capfd)
    assert code == 2, line
    assert fragment.format(**fill) in line, line
    assert _snapshot(*before) == before and sorted(run.rglob("*")) == sorted(p for p in before if p.is_relative_to(run))
    assert not (tmp_path / "backbone.json").exists()


def test_export_replaces_an_earlier_export_only_with_overwrite(run, tmp_path, capfd):
    """An earlier export is no exception: it may be another run's (the command cannot know)."""
    out = tmp_path / "bb.pt"
    assert _main(["export", "--checkpoint", str(run), "--out", str(out)], capfd)[0] == 0
    sidecar = json.loads((tmp_path / "bb.json").read_text())
    assert sidecar["unison"] == "backbone" and sidecar["file"] == "bb.pt"
    before = _snapshot(out, tmp_path / "bb.json")
    code, line = _main(["export", "--checkpoint", f"{run}/{CKPT1}", "--out", str(out)], capfd)
    assert code == 2 and line == (f"unison: error: --out {out} already exists (an earlier unison export); it is left "
                                  "as it is: pass --overwrite to replace it, or choose another --out")
    assert _snapshot(*before) == before
    assert _main(["export", "--checkpoint", f"{run}/{CKPT1}", "--out", str(out), "--overwrite"], capfd)[0] == 0
    assert json.loads((tmp_path / "bb.json").read_text())["step"] == 1   # step 2's export replaced by step 1's
    assert torch.load(out, weights_only=True)   # a state dict of tensors
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


EVAL_CASES = [
    ("eval-json-is-a-directory", "{tmp}", "--json {tmp} is a directory; give a file name, e.g. {tmp}/result.json"),
    ("eval-json-is-the-checkpoint", "{run}/" + CKPT1, "(--checkpoint), which this command reads"),
    ("eval-json-is-the-run-config", "{run}/config.json",
     "--json {run}/config.json already exists; it is left as it is: pass --overwrite to replace it"),
    ("eval-json-is-another-file", "{tmp}/notes.json",
     "--json {tmp}/notes.json already exists; it is left as it is: pass --overwrite to replace it"),
    ("eval-json-is-an-earlier-result", "{tmp}/earlier.json",
     "--json {tmp}/earlier.json already exists (an earlier unison eval result); it is left as it is: pass --overwrite"),
]


@pytest.mark.parametrize("case_id, target, fragment", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_json_is_refused_before_any_work(case_id, target, fragment, run, tmp_path, capfd):
    fill = {"run": str(run), "tmp": str(tmp_path)}
    (tmp_path / "notes.json").write_text('{"mine": 1}\n')
    (tmp_path / "earlier.json").write_text('{"unison": "eval", "knn_top1": 0.5}\n')
    checkpoint = f"{run}/{CKPT1}" if case_id == "eval-json-is-the-checkpoint" else str(run)
    before = _snapshot(*run.rglob("*"), tmp_path / "notes.json", tmp_path / "earlier.json")
    code, line = _main(["eval", "--checkpoint", checkpoint, "--json", target.format(**fill)], capfd)
    assert code == 2 and fragment.format(**fill) in line, line
    assert _snapshot(*before) == before


WRITES = "writes"   # the commands below, each reached through a variable: none starts a process (refused first)
WRITERS = [   # every command that writes a file the user names, and what it is given
    ("export", ["export", "--checkpoint", "{run}", "--out", "{file}"]),
    ("eval", ["eval", "--checkpoint", "{run}", "--json", "{file}"]),
    ("embed", ["embed", "--checkpoint", "{run}", "--data", "{tmp}/images", "--out", "{file}"]),
    ("plot", ["plot", "{tmp}/metrics.csv", "--out", "{file}"]),
    ("bench", ["bench", "comm", "--out", "{tmp}", "--workers", "2"]),
]
WRITTEN = {"export": "out.pt", "eval": "out.json", "embed": "out.npy", "plot": "out.png", "bench": "comm.md"}


@pytest.mark.parametrize("command, argv", WRITERS, ids=[w[0] for w in WRITERS])
def test_every_command_replaces_an_existing_file_only_with_overwrite(command, argv, run, tmp_path, capfd,
                                                                     monkeypatch):
    """One convention: an existing output is refused in one line naming --overwrite, before any work, whoever
    wrote it; every command that writes takes --overwrite."""
    import multiprocessing.process

    def refuse(*args, **kwargs):
        raise AssertionError("the existing output was not refused: a process started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    (tmp_path / "images" / "a").mkdir(parents=True)
    (tmp_path / "metrics.csv").write_text("step,epoch,loss,lr\n1,0.1,3.0,0.1\n")
    target = tmp_path / WRITTEN[command]
    target.write_bytes(b"mine")
    words = [w.format(run=run, tmp=tmp_path, file=target) for w in argv]
    code, line = _main(words, capfd)
    assert code == 2 and " left as " in line and ": pass --overwrite to replace " in line, line
    assert target.read_bytes() == b"mine"
    assert make_parser(command).parse_args([*words, "--overwrite"]).overwrite is True


# ------------------------------------------------------------------ the run directory a resume writes into
def _run_dir(tmp: Path, name: str, steps: list[int], latest: int | None = None) -> Path:
    folder = tmp / name / "checkpoints"
    folder.mkdir(parents=True)
    for s in steps:
        (folder / f"step_{s:08d}.pt").write_bytes(b"x")
    if latest is not None:
        (folder / "latest").write_text(f"step_{latest:08d}.pt\n")
    return tmp / name


def test_resume_from_an_early_checkpoint_into_its_own_run_is_refused(tmp_path):
    run = _run_dir(tmp_path, "run", [2, 4])
    with pytest.raises(ConfigError, match=r"--resume .*step_00000002.pt is step 2 of the run in .*run, whose latest "
                                          r"checkpoint is step_00000004.pt: resuming into .*run would overwrite its "
                                          r"later checkpoints; pass a new --out DIR to branch from step 2, or "
                                          r"--resume .*run to continue its latest"):
        check_resume_target(run / "checkpoints" / "step_00000002.pt", 2, run)
    check_resume_target(run / "checkpoints" / "step_00000004.pt", 4, run)   # its latest: continue
    check_resume_target(run, 4, run)                                        # --resume RUN_DIR
    check_resume_target(run / "checkpoints" / "step_00000002.pt", 2, tmp_path / "branch")   # a new --out


def test_resume_into_a_directory_with_later_checkpoints_is_refused(tmp_path):
    other, out = _run_dir(tmp_path, "other", [3]), _run_dir(tmp_path, "out", [2, 6], latest=6)
    with pytest.raises(ConfigError, match=r"--out .*out holds checkpoints up to step_00000006.pt, later than --resume "
                                          r".*step_00000003.pt \(step 3\)"):
        check_resume_target(other / "checkpoints" / "step_00000003.pt", 3, out)
    check_resume_target(other / "checkpoints" / "step_00000003.pt", 3, _run_dir(tmp_path, "older", [1, 2]))


def test_a_run_directory_has_one_owner(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(RunDirRefused, match=rf"run directory {tmp_path} is in use by another run \(pid {os.getpid()} "
                                              r"on .* since .*\); wait for it to end, or choose another --out"):
            RunDirLock(tmp_path).acquire()
    finally:
        first.release()
    with RunDirLock(tmp_path):   # released: the next run takes it
        pass


@pytest.mark.parametrize("kind", ["symlink", "hard-link", "fifo"])
def test_the_lock_file_is_never_written_through_a_link(tmp_path, kind):
    """`.unison.lock` is truncated once locked: a link to a user's file must be refused, not followed."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file\n")
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME
    {"symlink": lambda: lock.symlink_to(notes), "hard-link": lambda: os.link(notes, lock),
     "fifo": lambda: os.mkfifo(lock)}[kind]()
    what = {"symlink": "is a symbolic link", "hard-link": "has other hard links", "fifo": "is not a regular file"}[kind]
    with pytest.raises(RunDirRefused, match=f"{LOCK_NAME} {what}"):
        RunDirLock(run).acquire()
    assert notes.read_text() == "a user's file\n"


def test_an_unwritable_output_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"could not write .*file/sub/out.json: .*file is a file, not a folder; "
                                          r"choose another --json"):
        write_text_atomic(tmp_path / "file" / "sub" / "out.json", "{}", "--json")


@pytest.mark.parametrize("out, fragment", [("", r"^--out is empty; give a run directory, e.g. --out runs/x$"),
                                           ("a\x00b", r"^--out 'a\\x00b' is not a path \(a NUL character\)")],
                         ids=["empty", "nul"])
def test_an_out_that_is_not_a_folder_name_is_refused(out, fragment):
    """"" would be the current folder (the run's files among the user's); a NUL was a ValueError traceback."""
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig(out=out).validate()


@pytest.mark.parametrize("how", ["component-of-300", "path-of-5000"])
def test_an_out_past_the_file_systems_limits_is_one_line(how, tmp_path, capfd):
    """A 300-character folder name was one line naming the whole path and 'File name too long'; a path of 5,000
    characters was an OSError traceback from the pre-flight's stat."""
    out = tmp_path / ("a" * 300) if how == "component-of-300" else tmp_path / "/".join(["b" * 49] * 100)
    command = ["train"]   # refused by the configuration, before any process or file
    assert main([*command, "--world-size", "1", "--max-steps", "1", "--out", str(out)]) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    limit = ("is 300 bytes long, past the 255 a file or folder name may have" if how == "component-of-300" else
             "bytes long as an absolute path with the 64 bytes of the names written below it, past the 4095 a path "
             "may have")
    assert lines[0].startswith("unison: error: --out ") and limit in lines[0] and len(lines[0]) < 400, lines[0]
    assert not any(tmp_path.iterdir())


def test_an_output_files_name_leaves_room_for_its_temporary_name(tmp_path):
    from unison.paths import check_output

    check_output(tmp_path / ("x" * 230 + ".pt"), "--out")   # 233 bytes: its temporary name still fits
    with pytest.raises(ConfigError, match=r"is 240 bytes long, past the 233 \(255 less the 22 its temporary name "
                                          r"adds\) a file or folder name may have"):
        check_output(tmp_path / ("x" * 237 + ".pt"), "--out")


def _foreign(tmp: Path) -> Path:
    docs = tmp / "mydocs"
    docs.mkdir()
    for name in ("config.json", "summary.json", "metrics.csv", "plot.png"):
        (docs / name).write_text(f"the user's {name}\n")
    return docs


@pytest.mark.parametrize("config", ['{"method": "simclr"}', "[1, 2]", "not json", "fifo"],
                         ids=["config-without-resolved", "config-a-list", "config-not-json", "config-a-fifo"])
def test_a_fresh_run_refuses_a_folder_no_unison_run_wrote(tmp_path, config):
    docs = _foreign(tmp_path)
    if config == "fifo":   # read bounded and without blocking, like every file unison reads
        (docs / "config.json").unlink()
        os.mkfifo(docs / "config.json")
    else:
        (docs / "config.json").write_text(config)
    before = _snapshot(*docs.iterdir())
    with pytest.raises(RunDirRefused, match=rf"^--out {docs} already holds files that no unison run wrote \('config.json'"
                                            r", 'metrics.csv', 'plot.png', \.\.\.\); a run writes its config.json, .* "
                                            r"there and would replace them: choose a new or empty folder$"):
        check_run_dir(docs)
    assert _snapshot(*docs.iterdir()) == before and not (docs / LOCK_NAME).exists()


@pytest.mark.parametrize("mark", ["lock", "checkpoint", "config-of-a-run-before-the-lock", "empty", "missing"])
def test_a_run_directory_or_a_new_folder_is_accepted(tmp_path, mark):
    docs = _foreign(tmp_path) if mark not in ("empty", "missing") else tmp_path / "new"
    if mark == "empty":
        docs.mkdir()
    elif mark == "lock":
        (docs / LOCK_NAME).write_text("")
    elif mark == "checkpoint":
        (docs / "checkpoints").mkdir()
        (docs / "checkpoints" / "step_00000002.pt").write_bytes(b"x")
    elif mark == "config-of-a-run-before-the-lock":
        (docs / "config.json").write_text('{"method": "simclr", "resolved": {"backbone": "small_cnn"}}')
    check_run_dir(docs)   # a re-run or a resume of a run made before the lock existed stays possible


# -- with real processes --

W1 = ["--world-size", "1", "--batch-size", "8", "--max-steps", "2", "--no-random-init-knn", "--no-progress",
      "--subset", "64", "--val-subset", "16", "--knn-k", "5"]


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 1 and 2."""
    finished_run = tmp_path_factory.mktemp("outputs") / "run"
    assert main(["train", *W1, "--checkpoint-every", "1", "--out", str(finished_run)]) == 0
    return finished_run


def _train(argv: list[str], capfd) -> tuple[int, str]:
    capfd.readouterr()
    code = main(["train", *argv])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


def _files(finished_run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(finished_run)): p.read_bytes() for p in sorted(finished_run.rglob("*")) if p.is_file()}


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
def test_train_never_overwrites_another_runs_files(case_id, argv, fragment, finished_run, tmp_path, capfd, monkeypatch):
    from unison.data.generated import write_image_folder

    monkeypatch.chdir(tmp_path)   # where a run with --out '' wrote on the old code: never the checkout

    fill = {"run": str(finished_run), "tmp": str(tmp_path)}
    (tmp_path / "early.pt").write_bytes((finished_run / "checkpoints" / "step_00000001.pt").read_bytes())
    write_image_folder(tmp_path / "images", 16, classes=2, sizes=(16, 20), seed=0)
    (tmp_path / "links").mkdir()
    for name, target in (("a", "class_0"), ("b", "class_1")):   # class folders that are links to the data's
        (tmp_path / "links" / name).symlink_to(tmp_path / "images" / target)
    before, data_before = _files(finished_run), _files(tmp_path / "images")
    code, line = _train([*W1, *[a.format(**fill) for a in argv]], capfd)
    assert code == 2 and fragment.format(**fill) in line, line
    assert _files(finished_run) == before and _files(tmp_path / "images") == data_before


@pytest.mark.parametrize("how", ["fresh", "resume-auto", "resume-a-run", "current-folder"])
def test_a_folder_of_the_users_files_is_never_a_run_directory(how, finished_run, tmp_path, capfd, monkeypatch):
    docs = tmp_path / "mydocs"
    docs.mkdir()
    for name in ("config.json", "summary.json", "metrics.csv"):
        (docs / name).write_text(f"the user's {name}\n")
    before = _files(docs)
    extra = {"fresh": [], "resume-auto": ["--resume", "auto"], "resume-a-run": ["--resume", str(finished_run)],
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


def test_a_run_made_before_the_lock_existed_can_run_again(finished_run, tmp_path, capfd):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_bytes((finished_run / "config.json").read_bytes())   # no lock file, no checkpoints
    (old / "metrics.csv").write_text("step,loss\n")
    assert main(["train", *W1, "--out", str(old)]) == 0


def test_resume_branches_into_a_new_out_and_continues_its_latest(finished_run, tmp_path, capfd):
    before = _files(finished_run)
    assert main(["train", *W1, "--resume", f"{finished_run}/checkpoints/step_00000001.pt", "--max-steps", "3",
                 "--checkpoint-every", "1", "--out", str(tmp_path / "branch")]) == 0
    assert (tmp_path / "branch" / "checkpoints" / "step_00000003.pt").is_file() and _files(finished_run) == before


def test_run_directory_on_a_full_disk_is_one_line(tmp_path, capfd):
    with full_tmpfs(tmp_path / "fs") as fs:
        code, line = _train([*W1, "--out", str(fs / "run")], capfd)
        assert code == 2
        assert line == (f"unison: error: no space left on device: could not write {fs / 'run' / '.unison.lock'}; "
                        "free space or choose another --out")


@pytest.mark.parametrize("world", ["1", "2"])
def test_embed_onto_a_full_disk_is_one_line_naming_what_is_kept(finished_run, world, tmp_path, capfd):
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
            code = main(["embed", "--checkpoint", str(finished_run), "--data", str(images.parent), "--out", str(out),
                         "--world-size", world, "--batch-size", "64", *extra])
            err = capfd.readouterr().err
            lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
            assert lines[0].endswith(f"no space left on device: could not write {out}; {kept}; free space or choose "
                                     "another --out"), lines[0]
        assert sorted(p.name for p in fs.iterdir()) == ["e.npy"] and (fs / "e.npy").read_bytes() == b"an earlier output"
