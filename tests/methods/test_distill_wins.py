"""A student distilled from a unison-trained teacher beats the same student trained from scratch (issue 25).

The winning row of benchmarks/distill_digits_teachers.sh as a test, on the embedded digits at the main job's
settings (2 gloo workers, small CNN, global batch 256, kNN k=200 on the 359 held-out images): a MoCo teacher
trained by unison for 600 steps (``--epochs 120``), then the same small CNN (same seed, same initial weights)
for 150 steps (``--epochs 30``), distilled from it at ``--method distill``'s defaults and trained from scratch
with SimCLR (the main job). Measured here: 0.9387 against 0.8914 (+17 of 359 images); the teacher 0.9638.

Distillation needs a teacher trained well beyond the student's own steps: with a teacher of the student's length,
or at the few steps a CI test affords (world size 1, batch 64, 20-44 steps), the distilled student stays below
training from scratch (docs/benchmarks.md). This test therefore takes about 5 minutes on 2 cores and runs only
when ``UNISON_LONG_TESTS=1`` is set; the suite skips it with that reason.
"""

from __future__ import annotations

import json
import os

import pytest

from unison.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("UNISON_LONG_TESTS") != "1",
                                 reason="set UNISON_LONG_TESTS=1: trains a 600-step teacher (about 5 min on 2 cores)")]

COMMON = ["--no-progress", "--no-random-init-knn"]


def _knn(run) -> float:
    return float(json.loads((run / "summary.json").read_text())["knn_top1"])


def test_a_student_distilled_from_a_longer_trained_teacher_beats_the_same_student_from_scratch(tmp_path):
    teacher, distilled, scratch = tmp_path / "teacher", tmp_path / "distilled", tmp_path / "scratch"
    assert main(["train", *COMMON, "--method", "moco", "--epochs", "120", "--out", str(teacher)]) == 0
    assert main(["train", *COMMON, "--method", "distill", "--teacher", str(teacher), "--out", str(distilled)]) == 0
    assert main(["train", *COMMON, "--method", "simclr", "--out", str(scratch)]) == 0
    steps = {run.name: json.loads((run / "summary.json").read_text())["steps"] for run in (distilled, scratch)}
    assert steps == {"distilled": 150, "scratch": 150}, steps
    knn = {run.name: _knn(run) for run in (teacher, distilled, scratch)}
    print(knn)
    assert knn["teacher"] > knn["distilled"] > knn["scratch"] + 0.02, knn
