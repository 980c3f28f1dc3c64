"""The run directory's record of the torchrun group that trained it: how a re-formed group of the same job, which
counts no restart, knows to resume (a one-process gloo group)."""

from __future__ import annotations

import datetime
import hashlib
import json

import pytest
import torch
import torch.distributed as dist

from unison.distributed import elastic


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_a_group_of_the_same_torchrun_job_finds_the_previous_one_in_the_run_directory(tmp_path, monkeypatch,
                                                                                      one_process_group):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")   # a re-form for a joining node counts no restart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    assert elastic.previous_group() is None   # the job's first group
    elastic.note_progress(12)
    assert (tmp_path / elastic.RECORD).read_bytes().endswith(b"\n")
    assert json.loads((tmp_path / elastic.RECORD).read_text()) == {
        "job_sha256": hashlib.sha256(b"job-1").hexdigest(), "world_size": 1, "step": 12}
    assert elastic.recorded_here(tmp_path)   # what the pre-flight of a re-formed group's workers sees
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    assert elastic.previous_group() == elastic.PreviousGroup(world_size=1, step=12)
    elastic.note_progress(20, done=True)   # the run finished: a later job with the same id is a new run
    assert not elastic.recorded_here(tmp_path)
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    assert elastic.previous_group() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")   # another job in the same directory: a first group
    assert not elastic.recorded_here(tmp_path)
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    assert elastic.previous_group() is None
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")    # not torchrun: nothing recorded, nothing found
    elastic.join_elastic(tmp_path / "other", torch.device("cpu"))
    assert elastic.previous_group() is None and not (tmp_path / "other").exists()


@pytest.mark.parametrize("job", ["j" * 200, "\u00e9" * 60, "job-\u4e2d\u6587-" + "x" * 300],
                         ids=["200-characters", "60-accented-letters", "long-and-not-ascii"])
def test_a_job_id_of_any_length_and_characters_is_recognised(job, tmp_path, monkeypatch, one_process_group):
    """The record keeps a hash of the whole id: an id longer than the record's line, or one that JSON escapes to
    six bytes a letter, is still its own job's (and another id that shares its first 150 characters is not)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    elastic.note_progress(7)
    assert len((tmp_path / elastic.RECORD).read_bytes()) == 256
    assert elastic.recorded_here(tmp_path)
    elastic.join_elastic(tmp_path, torch.device("cpu"))
    assert elastic.previous_group() == elastic.PreviousGroup(world_size=1, step=7)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job[:150] + "-other")
    assert not elastic.recorded_here(tmp_path)
