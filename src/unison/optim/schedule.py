"""The learning-rate schedule of a run, and where its steps fall on it when a ``--time-budget`` run is re-planned late.

`Schedule`: a linear warm-up to the peak over ``warmup_steps``, then a cosine to 0 at the schedule's end::

    lr(t) = peak min(t + 1, W) / W                                        t < W
    lr(t) = peak (r + (1 - r) (1 + cos(pi min(1, (t - W) / (T - W)))) / 2)  otherwise

with r the share of the peak it ends at (``--final-lr-ratio``, default 0).

`Stretch`: a budgeted run that turns out slower (or faster) than planned, past its warm-up, plans a new step count
S (`unison.training.replan`). Planning the cosine for S from step 0 would make the learning rate jump at that step
(a shorter run is further down its cosine at the same step). Instead the steps left are laid onto what is left of
the schedule: at each such re-plan (step s_i, where the schedule stood at position p_i) a knot is added, and

    position(t) = t                                               t <= s_0
    position(t) = p_i + (t - s_i) (p_{i+1} - p_i) / (s_{i+1} - s_i)   between knots (the last knot's next: (S, P))

where P is the schedule's length. The learning rate, the momentum and the teacher temperature continue from the
values they had and end exactly at the run's last step. Without a late re-plan there is no stretch, and a step is
its own position (the same floats as an unstretched run's: nothing is computed).

Example::

    schedule = Schedule(peak_lr=0.6, warmup_steps=10, total_steps=120, stretch=Stretch(((60, 60.0),), 120, 100))
    schedule.lr(60) == Schedule(0.6, 10, 100).lr(60)   # continuous at the knot; lr(120) == 0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Stretch:
    """The knots ``(step, position)`` of the late re-plans, in step order; the run's `steps` end at `length`."""

    knots: tuple[tuple[int, float], ...]
    steps: int
    length: int

    def position(self, step: float) -> float:
        """Where step `step` of the run falls on the schedules (a float: the stretched steps fall between theirs)."""
        if not self.knots or step <= self.knots[0][0]:
            return step
        ends = [*self.knots, (self.steps, float(self.length))]
        i = next((i for i in range(1, len(ends)) if step <= ends[i][0]), len(ends) - 1)   # past the end: the last
        (s0, p0), (s1, p1) = ends[i - 1], ends[i]
        return p0 + (step - s0) * (p1 - p0) / max(1, s1 - s0)

    def replanned(self, at: int, steps: int) -> Stretch:
        """This stretch with a knot at step `at` (where the schedules stand now) and `steps` steps in all."""
        return Stretch((*self.knots, (at, self.position(at))), steps, self.length)

    def as_record(self) -> dict[str, object]:
        return {"knots": [[s, p] for s, p in self.knots], "length": self.length}

    @classmethod
    def of_record(cls, record: dict[str, object], steps: int) -> Stretch:
        knots = tuple((int(s), float(p)) for s, p in record["knots"])   # type: ignore[attr-defined]
        return cls(knots, steps, int(record["length"]))   # type: ignore[call-overload]


def no_stretch(steps: int) -> Stretch:
    """The identity: a run whose steps are the schedule's (the start of a first late re-plan)."""
    return Stretch((), steps, steps)


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up to `peak_lr` over `warmup_steps`, then cosine decay to ``final_ratio * peak_lr`` at the last of
    `total_steps` (the run's steps; with a `stretch`, its positions on a schedule of ``stretch.length`` steps)."""

    peak_lr: float
    warmup_steps: int
    total_steps: int
    stretch: Stretch | None = None
    final_ratio: float = 0.0   # the cosine ends at this share of the peak (``--final-lr-ratio``)

    @property
    def length(self) -> int:
        """The schedule's own length: the method's schedules (momentum, temperature) are planned for it."""
        return self.stretch.length if self.stretch is not None else self.total_steps

    def lr(self, step: float) -> float:
        t = self.stretch.position(step) if self.stretch is not None else step
        if self.warmup_steps and t < self.warmup_steps:
            # a stretched step can fall inside the ramp's last step: capped, it does not pass the peak
            return self.peak_lr * min(t + 1, self.warmup_steps) / self.warmup_steps
        progress = (t - self.warmup_steps) / max(1, self.length - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.peak_lr * (cosine if not self.final_ratio else self.final_ratio + (1 - self.final_ratio) * cosine)
