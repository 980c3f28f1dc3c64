"""Resume: an interrupted run continued from its last checkpoint ends exactly where an uninterrupted one does.

The checkpoint carries the model (with momentum encoders, queues and centres, which are in the
method's state_dict), the optimizer (ZeRO-1 shards consolidated), the step (from which the learning
rate and the data position are derived) and the RNG state. Runs use float64, so "the same" means
1e-9 relative. Interruptions come from the testing-only ``UNISON_FAULT_INJECT`` hook.
"""

from __future__ import annotations

import fault_injection
import pytest

from unison.cli import main
from unison.equivalence import assert_states_close
from unison.training.checkpoint import load_checkpoint

FAULT = "UNISON_FAULT_INJECT"


TINY = ["--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--precision", "float64", "--max-steps", "4", "--checkpoint-every", "2", "--log-every", "1"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    monkeypatch.delenv(FAULT, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    fault_injection.register(monkeypatch)


@pytest.mark.parametrize("method, how", [("moco", "resume-auto"), ("dino", "torchrun-restart")])
def test_interrupted_run_resumes_to_the_uninterrupted_result(method, how, tmp_path, monkeypatch):
    common = ["train", *TINY, "--world-size", "1", "--method", method]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main([*common, "--out", str(ref)]) == 0

    monkeypatch.setenv(FAULT, "rank=0,step=3,kind=nan")  # fails at step 3, after the step-2 checkpoint
    assert main([*common, "--resume", "auto", "--out", str(run)]) == 5  # auto: nothing to resume, a fresh run
    assert load_checkpoint(run)["step"] == 2
    if how == "resume-auto":
        monkeypatch.delenv(FAULT)
        assert main([*common, "--resume", "auto", "--out", str(run)]) == 0
    else:  # what torchrun does: the same command again, with TORCHELASTIC_RESTART_COUNT=1 and no --resume
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the fault fires in attempt 0 only
        assert main([*common, "--out", str(run)]) == 0

    final, expected = load_checkpoint(run), load_checkpoint(ref)
    assert final["step"] == expected["step"] == 4
    buffers = [k for k in expected["model"] if "queue" in k or "center" in k or "teacher" in k or "momentum" in k]
    assert buffers, "no momentum encoder, queue or centre in the state: the test would not cover them"
    assert_states_close(final["model"], expected["model"], where="model")
    assert_states_close(final["optimizer"], expected["optimizer"], where="optimizer")
    assert_states_close(final["history"]["random_init_knn_top1"], expected["history"]["random_init_knn_top1"])


@pytest.mark.slow
def test_sharded_optimizer_state_resumes_at_another_world_size(tmp_path):
    """ZeRO-1 at W=2: the checkpoint holds the consolidated state, which a W=1 run continues exactly."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *TINY, "--shard-optimizer", "--out", str(a)]) == 0
    mid = a / "checkpoints" / "step_00000002.pt"
    assert main(["train", "--resume", str(mid), "--world-size", "1", "--out", str(b), "--no-progress"]) == 0
    full, resumed = load_checkpoint(a), load_checkpoint(b)
    assert resumed["step"] == full["step"] == 4 and resumed["world_size"] == 1 and full["world_size"] == 2
    assert_states_close(resumed["model"], full["model"], where="model")
    assert_states_close(resumed["optimizer"], full["optimizer"], where="optimizer")
