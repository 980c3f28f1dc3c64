"""Hostile or damaged checkpoint contents: every field read from a checkpoint is refused in one line (exit 4).

The cases drive ``unison train`` (at W=1 in this process), so they carry the `distributed` marker (every
``main(["train", ...])`` does: tests/conftest.py). One real 2-step run (W=1) is made once; each case edits a copy of its last
checkpoint (``torch.load`` with ``weights_only=True``, change one field, ``torch.save``) and hands it to
``unison train --resume`` (a few to ``unison eval``/``export`` too). Each must exit 4 with exactly one
``unison: error:`` line naming the checkpoint and the field, no traceback, and leave the run directory as it was.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_helpers import error_line, run_cli
from helpers.dcp_checkpoint import small_sharded_checkpoint

from unison.cli import main
from unison.training.checkpoint import read_header, read_metadata_safely
from unison.training.checkpoint.contents import MAX_STEP
from unison.training.owner import LOCK_NAME
from unison.version import __version__

W1 = ["--world-size", "1", "--batch-size", "8", "--no-random-init-knn", "--no-progress"]


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Any]:
    """A 2-step run with a checkpoint at every step: its last checkpoint, loaded, and the run directory."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    assert main(["train", *W1, "--max-steps", "2", "--checkpoint-every", "1", "--out", str(run)]) == 0
    path = run / "checkpoints" / "step_00000002.pt"
    return {"run": run, "path": path, "ckpt": torch.load(path, weights_only=True)}


def _edited(good: dict[str, Any], tmp_path: Path, edit) -> Path:
    ckpt = copy.deepcopy(good["ckpt"])
    edit(ckpt)
    path = tmp_path / "bad.pt"
    torch.save(ckpt, path)
    return path


def _set(*keys: Any, value: Any):
    """An edit that sets ckpt[k1][k2]... = value."""
    def edit(ckpt: dict[str, Any]) -> None:
        d = ckpt
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _opt_shape(ckpt: dict[str, Any]) -> None:
    ckpt["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3, 3)


def _opt_one_element(ckpt: dict[str, Any]) -> None:   # one element is not a scalar: the update would not broadcast
    ckpt["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(1)


def _first_weight(value):
    """An edit of the model's first weight: `value(weight)` replaces it."""
    def edit(ckpt: dict[str, Any]) -> None:
        key = next(iter(ckpt["model"]))
        ckpt["model"][key] = value(ckpt["model"][key])
    return edit


def _opt_groups(ckpt: dict[str, Any]) -> None:
    ckpt["optimizer"]["param_groups"].append(copy.deepcopy(ckpt["optimizer"]["param_groups"][0]))


def _run(argv: list[str], capfd) -> tuple[int, str]:
    return run_cli(argv, capfd)


def _line(err: str) -> str:
    line = error_line(err)
    assert len(line) < 600, line     # strings from the file are shown bounded
    return line


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file's hash but the run log (the error line is appended) and the owner's lock file (a refused run
    owned the directory while it checked the checkpoint: unison.training.owner)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in ("train.log", LOCK_NAME)}


# (id, edit, message fragment): refused by the header read in the launching process (and again by the worker)
HEADER_CASES = [
    ("step-huge", _set("step", value=10**18), f"invalid step (1000000000000000000; an integer from 0 to {MAX_STEP})"),
    ("step-negative", _set("step", value=-5), "invalid step (-5;"),
    ("step-bool", _set("step", value=True), "invalid step (True;"),
    ("step-float", _set("step", value=2.0), "invalid step (2.0;"),
    ("step-str", _set("step", value="2"), "invalid step ('2';"),
    ("step-past-its-run", _set("step", value=5), "invalid step (5 is past the 2 steps of the run that saved it)"),
    ("step-2**70", _set("step", value=2**70), "invalid step (an integer of 71 bits;"),
    ("version-str", _set("version", value="1"), "invalid format version '1'"),
    ("method-huge", _set("method", value="x" * 10**6), "invalid method ('xxxx"),
    ("method-int", _set("method", value=7), "invalid method (7;"),
    ("config-distributed-scalar", _set("config", "distributed", value=5), "'distributed' must be a mapping"),
    ("config-method-params-list", _set("config", "method_params", value=[1]), "method_params must be a dict, not a list"),
    ("config-epochs-negative", _set("config", "epochs", value=-3), "epochs=-3 must be an integer >= 1"),
    ("config-data-int", _set("config", "data", value=5), "data must be a str, not 5"),
    ("config-world-size-str", _set("config", "distributed", "world_size", value="two"), "world_size"),
    ("config-out-huge", _set("config", "out", value="d" * 100_000), "config.out is a string of 100000 characters"),
    ("config-unknown-method", _set("config", "method", value="evil"), "method='evil' is unknown"),
    ("config-int-key", _set("config", "method_params", value={1: 2}), "has the key 1; keys must be short strings"),
    ("history-str", _set("history", "knn_top1", value="high"), "invalid history ('knn_top1': 'high';"),
    ("history-list", _set("history", value=[0.5]), "invalid history (a list;"),
    ("world-size-zero", _set("world_size", value=0), "invalid world_size (0;"),
    ("rng-missing-ranks", _set("rng", value=[]), "invalid rng (a list; one RNG state per rank, 1 in all)"),
    ("rng-torch-short", _set("rng", 0, "torch", value=torch.zeros(10, dtype=torch.uint8)), "invalid rng[0] (torch:"),
    ("rng-python-words", _set("rng", 0, "python", "state", value=torch.full((625,), -1)), "invalid rng[0] (python:"),
    ("rng-numpy-pos", _set("rng", 0, "numpy", "pos", value=10**9), "invalid rng[0] (numpy:"),
    ("rng-str", _set("rng", 0, value="seed"), "invalid rng[0] (str, not the dict"),
    ("extra-scalar", _set("extra", value={"grad_scaler": 5}), "invalid extra state ('grad_scaler' is not a dict"),
    ("extra-per-rank-short", _set("extra", value={"powersgd": {"per_rank": True, "world_size": 4, "state": []}}),
     "'powersgd' is per rank but does not hold one state for each of its 4 ranks"),
    ("resolved-mean-str", _set("resolved", "mean", value="grey"), "invalid resolved recipe (mean is not a list of 1 to 4 numbers"),
    ("resolved-mean-huge", _set("resolved", "mean", value=[1e300, 0.0, 0.0]), "invalid resolved recipe (mean is not"),
    ("resolved-image-size", _set("resolved", "image_size", value=-1), "invalid resolved recipe (image_size -1"),
    ("resolved-backbone-int", _set("resolved", "backbone", value=3), "backbone 3 is not a backbone name"),
    ("resolved-run-id-path", _set("resolved", "run_id", value="../x"), "run_id '../x' is not a run id"),
]

# refused by the worker, which has the model and optimizer to compare with
WORKER_CASES = [
    ("optimizer-state-shape", _opt_shape, "parameter 0 'momentum_buffer': shape (3, 3), the parameter has (32, 3, 3, 3)"),
    ("optimizer-state-one-element", _opt_one_element,
     "parameter 0 'momentum_buffer': shape (1,), the parameter has (32, 3, 3, 3)"),
    ("optimizer-groups", _opt_groups, "2 parameter group(s), the optimizer has 1"),
    ("optimizer-momentum-str", _set("optimizer", "param_groups", 0, "momentum", value="fast"),
     "parameter group 0: momentum='fast'"),
    ("optimizer-state-list", _set("optimizer", "state", value=[1]), "not a dict with 'state' and 'param_groups'"),
    ("optimizer-params-twice", _set("optimizer", "param_groups", 0, "params", value=[0] * 17),
     "parameter group 0 names a parameter twice"),
    ("optimizer-lr-nan", _set("optimizer", "param_groups", 0, "lr", value=float("nan")), "parameter group 0: lr=nan"),
    ("model-list", _first_weight(lambda w: w.tolist()), "model state backbone.features.0.weight is a list, not a tensor"),
    ("model-nan", _first_weight(lambda w: torch.full_like(w, float("nan"))),
     "model state backbone.features.0.weight holds NaN or infinite values"),
    ("model-int-weights", _first_weight(lambda w: w.long()),
     "backbone.features.0.weight has dtype torch.int64 in the checkpoint but torch.float32 in the model"),
    ("optimizer-momentum-nan", lambda c: c["optimizer"]["state"][0]["momentum_buffer"].fill_(float("nan")),
     "parameter 0 'momentum_buffer': NaN or infinite values"),
    ("optimizer-missing", lambda c: c.pop("optimizer"), "optimizer state that does not fit this run's optimizer (the "
     "checkpoint holds none)"),
    ("model-missing", lambda c: c.pop("model"), "holds no model state; pass a checkpoint of a training run"),
    ("model-not-dict", _set("model", value=[1, 2]), "model state must be a dict (a state_dict), got list"),
    ("model-huge-key", _set("model", "k" * 100_000, value=torch.zeros(1)), "1 unexpected key (kkkkkkkk"),
]


@pytest.mark.parametrize("case_id,edit,fragment", HEADER_CASES + WORKER_CASES, ids=[c[0] for c in HEADER_CASES + WORKER_CASES])
def test_a_damaged_checkpoint_is_refused_on_resume(case_id, edit, fragment, good, tmp_path, capfd):
    bad = _edited(good, tmp_path, edit)
    out = tmp_path / "out"
    code, err = _run(["train", *W1, "--max-steps", "3", "--resume", str(bad), "--out", str(out)], capfd)
    line = _line(err)
    assert code == 4, err
    assert fragment in line and (f"checkpoint {bad}" in line or "checkpoint does not match the model:" in line), line
    assert not _snapshot(out) if out.exists() else True      # nothing but the error in train.log


def test_resume_in_place_leaves_the_run_directory_as_it_was(good, tmp_path, capfd):
    """Resuming a run directory whose latest checkpoint is hostile: refused, every file as it was."""
    for case_id, edit, _ in (HEADER_CASES[0], WORKER_CASES[0]):
        run = tmp_path / case_id
        shutil.copytree(good["run"], run)
        torch.save(torch.load(_edited(good, tmp_path, edit), weights_only=True), run / "checkpoints" / "step_00000002.pt")
        before = _snapshot(run)
        code, err = _run(["train", *W1, "--max-steps", "3", "--resume", str(run)], capfd)
        _line(err)
        assert code == 4 and _snapshot(run) == before, err


def _from_another_version(ckpt: dict[str, Any]) -> None:
    """As a later unison writes it: options this one does not know, at the top, under distributed, of the method."""
    ckpt["unison_version"] = "9.0.0"
    ckpt["config"]["ema_schedule"] = "cosine"
    ckpt["config"]["distributed"]["overlap_optimizer"] = True
    ckpt["config"]["method_params"]["temperature_warmup"] = 0.04


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_checkpoint_of_another_version_is_read_with_one_line_naming_what_this_one_does_not_know(
        command, good, tmp_path, capfd):
    bad = _edited(good, tmp_path, _from_another_version)
    argv = (["train", *W1, "--max-steps", "3", "--resume", str(bad), "--out", str(tmp_path / "out")]
            if command == "train" else ["eval", "--checkpoint", str(bad), "--no-linear"])
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    said = capfd.readouterr().err + "\n".join(str(w.message) for w in caught)
    line = (f"checkpoint {bad} was written by unison 9.0.0 (this is unison {__version__}), with option(s) this "
            "version does not know: ema_schedule, distributed.overlap_optimizer, method_params.temperature_warmup; "
            "they are left out and the rest of the checkpoint is read")
    assert said.count(line) == 1 and "damaged" not in said, said


def test_checkpoint_past_this_runs_steps_is_refused(good, capfd):
    code, err = _run(["train", *W1, "--max-steps", "1", "--resume", str(good["path"]), "--out", str(good["run"])],
                     capfd)
    assert code == 4 and "is at step 2, past the 1 step of this run; give more --epochs" in _line(err), err


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("case_id", ["step-huge", "config-distributed-scalar", "config-method-params-list",
                                     "resolved-image-size", "resolved-mean-huge", "model-missing", "model-nan"])
def test_a_damaged_checkpoint_is_refused_by_eval_and_export(command, case_id, good, tmp_path, capfd):
    _, edit, fragment = next(c for c in HEADER_CASES + WORKER_CASES if c[0] == case_id)
    bad = _edited(good, tmp_path, edit)
    out = tmp_path / ("backbone.pt" if command == "export" else "report.json")
    argv = ["export", "--checkpoint", str(bad), "--out", str(out)] if command == "export" else \
        ["eval", "--checkpoint", str(bad), "--json", str(out)]
    code, err = _run(argv, capfd)
    assert code == 4 and fragment in _line(err), err
    assert not out.exists()


def _dcp(tmp_path: Path) -> Path:
    return small_sharded_checkpoint(tmp_path / "sharded", 3)


def test_a_damaged_dcp_header_is_refused(good, tmp_path, capfd):
    path = _dcp(tmp_path)
    header = torch.load(path / "unison.pt", weights_only=True)
    header["step"] = 10**18
    torch.save(header, path / "unison.pt")
    code, err = _run(["train", *W1, "--method", "byol", "--resume", str(path), "--out", str(tmp_path / "o")], capfd)
    assert code == 4 and f"checkpoint {path} has an invalid step (1000000000000000000" in _line(err), err


def test_dcp_metadata_claiming_more_than_its_shards_is_refused(tmp_path):
    path = _dcp(tmp_path)
    metadata = read_metadata_safely(path)
    md = metadata.state_dict_metadata["model.weight"]
    md.size = torch.Size([10**6, 10**6])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(Exception, match=r"describes 'model.weight' as torch.Size\(\[1000000, 1000000\]\) of "
                                        r"torch.float32, more than its \d+ bytes of shards hold"):
        read_header(path)


def test_checkpoint_that_is_a_fifo_is_refused_without_blocking(tmp_path, capfd):
    fifo = tmp_path / "step_00000001.pt"
    os.mkfifo(fifo)
    code, err = _run(["train", *W1, "--resume", str(fifo), "--out", str(tmp_path / "o")], capfd)
    assert code == 4 and f"checkpoint {fifo} is not a regular file" in _line(err), err
