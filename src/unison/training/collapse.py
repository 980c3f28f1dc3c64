"""When the label-free signals say the representation collapsed (`collapsed`), and what to say about it; read by
`unison.training.trainer.Trainer` after every evaluation. Collapse is judged on
`unison.config.train.MIN_COLLAPSE_IMAGES` held-back images or more."""

from __future__ import annotations

from unison.training.metrics import COLLAPSE_STD_LINE

COLLAPSE_STD = COLLAPSE_STD_LINE   # 0.05: embedding std x sqrt(d) below this: collapsed (see `collapsed`)
COLLAPSE_RANK = 0.01        # RankMe below this fraction of min(N, d), and below 2 at least: collapsed
COLLAPSE_RANK_FLOOR = 2.0
COLLAPSE_EVALS = 2          # ... for this many evaluations in a row


def collapsed(values: dict[str, float]) -> str | None:
    """What collapsed, or None.

    Thresholds: a random-initialised ReLU network's features already share one direction, so its std x sqrt(d)
    and RankMe are low; healthy training raises them, and even a dip of a healthy run stays above a random
    network's std; a collapsing run's std falls by orders of magnitude within a few steps (SimSiam §4.1 reports
    1e-3 x sqrt(d) for its collapse). `COLLAPSE_STD` lies between, below a random network's; RankMe below
    max(2, 1 % of min(N, d)) means at most a couple of directions carry the embedding, which a healthy run does
    not show. Either one for `COLLAPSE_EVALS` evaluations in a row counts (one evaluation may dip)."""
    what = []
    if values["emb_std"] < COLLAPSE_STD:
        what.append(f"embedding std {values['emb_std']:.3g}/sqrt(d) < {COLLAPSE_STD}/sqrt(d)")
    floor = max(COLLAPSE_RANK_FLOOR, COLLAPSE_RANK * values["rankme_max"])
    if values["rankme"] < floor:
        what.append(f"RankMe {values['rankme']:.3g} < {floor:.3g} (of at most {values['rankme_max']:.0f})")
    return " and ".join(what) or None


COLLAPSE_ADVICE = ("what usually helps: a lower --lr, a longer --warmup-epochs, the method's recipe optimizer and "
                   "augmentation, a larger batch, and for simsiam/byol the predictor (and its stop-gradient)")
