"""The learning-rate schedule and its stretch: a budgeted run re-planned late lays the steps it has left onto what is
left of its schedules, so the learning rate goes on from where it was, without a jump, and reaches 0 exactly at the
new last step, shorter or longer, however many times it is re-planned. ``--final-lr-ratio`` ends it above 0."""

import math

import pytest
import torch

from unison.config import DistributedConfig, TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.errors import ConfigError
from unison.optim.schedule import Schedule, Stretch, no_stretch
from unison.training.step import build_run


def test_the_schedule_warms_up_then_decays_to_zero_at_its_last_step():
    s = Schedule(peak_lr=0.8, warmup_steps=4, total_steps=20)
    assert [s.lr(t) for t in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert s.lr(12) == pytest.approx(0.4) and s.lr(20) == 0.0 and s.length == 20
    assert all(s.lr(t) > s.lr(t + 1) for t in range(4, 20))


@pytest.mark.parametrize("new_steps", [70, 100, 160])   # slower than planned, on plan, faster
def test_a_late_replan_goes_on_from_where_the_schedule_was_and_ends_at_the_new_last_step(new_steps):
    planned = Schedule(0.6, 10, 100)
    stretched = Schedule(0.6, 10, new_steps, no_stretch(100).replanned(50, new_steps))
    assert [stretched.lr(t) for t in range(51)] == [planned.lr(t) for t in range(51)]   # up to the knot: the same
    assert stretched.lr(new_steps - 1) > 0.0 and stretched.lr(new_steps) == 0.0 and stretched.length == 100
    after = [stretched.lr(t) for t in range(50, new_steps + 1)]
    assert all(a > b for a, b in zip(after, after[1:]))
    # the largest step between two steps is the original cosine's, scaled by how much the remainder was squeezed
    worst = max(abs(a - b) for a, b in zip(after, after[1:]))
    assert worst <= 0.6 * math.pi / 2 / 90 * 50 / (new_steps - 50) + 1e-12


def test_two_late_replans_compose():
    once = no_stretch(100).replanned(50, 90)
    twice = once.replanned(70, 120)
    assert twice.knots == ((50, 50), (70, once.position(70)))
    assert [twice.position(t) for t in range(71)] == [once.position(t) for t in range(71)]
    assert twice.position(120) == 100.0 and twice.position(95) == pytest.approx((once.position(70) + 100) / 2)
    assert Stretch.of_record(twice.as_record(), 120) == twice
    assert Stretch.of_record({"knots": [[50, 50.0]], "length": 100}, 90) == once


def test_a_step_past_the_end_stays_on_the_last_segment():
    s = Schedule(1.0, 0, 80, no_stretch(100).replanned(40, 80))
    assert s.lr(80) == 0.0 and s.lr(85) == 0.0   # the cosine is clamped past its end


def test_the_cosine_ends_at_the_final_share_of_the_peak_also_when_stretched():
    s = Schedule(0.5, 10, 100, final_ratio=0.2)
    assert s.lr(9) == 0.5 and s.lr(10) == 0.5 and s.lr(100) == pytest.approx(0.1) and s.lr(55) == pytest.approx(0.3)
    stretched = Schedule(0.5, 10, 80, no_stretch(100).replanned(50, 80), 0.2)
    assert stretched.lr(50) == s.lr(50) and stretched.lr(80) == pytest.approx(0.1)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, float("nan")])
def test_a_final_ratio_outside_zero_to_one_is_refused(ratio, tmp_path):
    with pytest.raises(ConfigError, match="final_lr_ratio"):
        TrainConfig(final_lr_ratio=ratio, out=str(tmp_path)).validate()


def test_the_run_takes_the_final_ratio(tmp_path):
    cfg = TrainConfig(data="synthetic", batch_size=4, threads=1, out=str(tmp_path), final_lr_ratio=0.25, max_steps=6,
                      warmup_epochs=0, random_init_knn=False, signal_images=0, online_probe=False,
                      distributed=DistributedConfig(backend="local", world_size=1)).validate()
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    finally:
        shutdown_distributed(None)
    assert run.schedule.lr(6) == pytest.approx(0.25 * run.schedule.peak_lr)
