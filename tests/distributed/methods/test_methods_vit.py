"""The ViT-era methods at W=2 (real gloo processes) equal one process on the global batch.

One 2-process launch runs, for MAE, iBOT (centring and Sinkhorn), I-JEPA, LeJEPA and MoCo v3,
`unison.equivalence.record_steps` — the production step of `unison train` (method, DDP, the
recipe's AdamW and schedule, float64) on DIFFERENT data per rank, a tiny ViT
(``vit_micro_p4``, 2 blocks, on 16 px images: 16 patches) and 3 steps, so masks, EMA teachers, centres
and step-dependent SIGReg directions are exercised. The references run in one process.

The same launch checks, below the method level:

* masks: each rank draws the masks of its slice of a global batch of sample indices; they
  equal the rows of one process's masks of the whole batch (W=1 vs W=2, same indices);
* SIGReg and KoLeo gradients: z = X_r @ theta on each rank, the rank's loss backpropagated
  and the theta gradients averaged as DDP does; they equal the single-process gradient of
  the loss on the global batch (a non-differentiable all-reduce, Lightly's SIGReg bug
  lightly#1920, gives 1/W of it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unison.distributed.testing import run_in_workers
from unison.equivalence import max_rel_difference

WORLD = 2


LOCAL_BATCH = 4


STEPS = 3


TOL = 1e-6


CASES: dict[str, tuple[str, dict]] = {
    "mae": ("mae", dict(decoder_dim=16, decoder_depth=1, decoder_heads=2)),
    "ibot": ("ibot", dict(hidden_dim=16, bottleneck_dim=8, out_dim=32, momentum_base=0.9,
                          teacher_temp_warmup_fraction=0.5)),
    "ibot_sinkhorn": ("ibot", dict(hidden_dim=16, bottleneck_dim=8, out_dim=32, centering="sinkhorn")),
    "ijepa": ("ijepa", dict(predictor_dim=16, predictor_depth=1, predictor_heads=2, num_targets=2,
                            momentum_base=0.9)),
    "lejepa": ("lejepa", dict(proj_hidden_dim=16, proj_dim=8, num_slices=16)),
    "mocov3": ("mocov3", dict(proj_hidden_dim=16, proj_dim=8, pred_hidden_dim=16, momentum_base=0.9)),
}


GLOBAL_INDICES = torch.tensor([31, 4, 17, 99, 2, 56, 8, 1000])


def _specs(world: int) -> dict[str, dict]:
    from unison.equivalence import CheckSpec

    out = {}
    for key, (method, params) in CASES.items():
        d = dataclasses.asdict(CheckSpec(method=method, world_size=WORLD, steps=STEPS, local_batch=LOCAL_BATCH,
                                         image_size=16, backbone="vit_micro_p4", method_params=params))
        if world == 1:
            d.update(world_size=1, local_batch=LOCAL_BATCH * WORLD)
        out[key] = d
    return out


def _masks() -> dict[str, torch.Tensor]:
    from unison.distributed import collectives as C
    from unison.methods import SampleKeys
    from unison.methods.masking import block_masking, random_masking

    keys = SampleKeys(seed=5, epoch=1, indices=GLOBAL_INDICES[C.local_slice(len(GLOBAL_INDICES))])
    return {"random": random_masking(keys, 3, 64, 40)[1], "blocks": block_masking(keys, 9, 8, 4, (3, 3))[0]}


def _loss_gradients() -> dict[str, torch.Tensor]:
    """d(loss)/d(theta) for z = X @ theta as DDP computes it: each rank's gradient, averaged over ranks."""
    from unison.distributed import collectives as C
    from unison.losses import KoLeoLoss, LeJEPALoss, sigreg_directions

    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)[C.local_slice(12)]
    a = sigreg_directions(0, 0, 4, 6, dtype=torch.float64)
    losses = {"sigreg": lambda z: LeJEPALoss(lambd=1.0)(z[None], n_global=1, directions=a), "koleo": KoLeoLoss()}
    out = {}
    for name, loss_fn in losses.items():
        theta = torch.randn(5, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64, requires_grad=True)
        loss_fn(x @ theta).backward()
        out[name] = C.all_reduce_no_grad(theta.grad, average=True)
    return out


def _distributed_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    out = {key: record_steps(spec) for key, spec in specs.items()}
    out["_masks"], out["_grads"] = _masks(), _loss_gradients()
    return out


def _reference_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    out = {key: record_steps(spec) for key, spec in specs.items()}
    out["_masks"], out["_grads"] = _masks(), _loss_gradients()
    return out


@pytest.fixture(scope="module")
def runs():
    multi = run_in_workers(_distributed_worker, WORLD, args=(_specs(WORLD),), timeout_s=600)
    single = run_in_workers(_reference_worker, 1, args=(_specs(1),), backend="local")[0]
    return multi, single


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_equal_one_process(runs, case):
    multi, single = runs
    for r in range(WORLD):
        m, s = multi[r][case], single[case]
        assert len(m["losses"]) == len(s["losses"]) == STEPS
        for step in range(STEPS):
            ml, sl = float(m["losses"][step]), float(s["losses"][step])
            assert abs(ml - sl) <= TOL * abs(sl), f"step {step}: loss {ml} vs {sl}"
            d, k = max_rel_difference(m["grads"][step], s["grads"][step])
            assert d < TOL, f"rank {r} step {step}: gradient of {k} differs by {d:.2e}"
            d, k = max_rel_difference(m["states"][step], s["states"][step])
            assert d < TOL, f"rank {r} step {step}: state {k} differs by {d:.2e}"
    assert multi[0][case]["identical"], "the state differs between ranks"
    assert multi[0][case]["note"] is None


@pytest.mark.distributed
@pytest.mark.slow
def test_teachers_and_centres_moved(runs):
    _, single = runs
    first, last = single["ibot"]["states"][0], single["ibot"]["states"][-1]
    assert last["loss_fn.center"].abs().sum() > 0 and last["loss_fn.patch_center"].abs().sum() > 0
    assert not torch.equal(first["teacher.head.last_layer.weight"], last["teacher.head.last_layer.weight"])
    assert int(single["lejepa"]["states"][-1]["step_count"]) == STEPS


@pytest.mark.distributed
@pytest.mark.slow
def test_masks_are_the_same_at_one_and_two_workers(runs):
    multi, single = runs
    for kind in ("random", "blocks"):
        gathered = torch.cat([multi[r]["_masks"][kind] for r in range(WORLD)])
        assert torch.equal(gathered, single["_masks"][kind]), kind


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigreg", "koleo"])
def test_global_batch_regularisers_have_exact_gradients(runs, loss):
    multi, single = runs
    for r in range(WORLD):
        torch.testing.assert_close(multi[r]["_grads"][loss], single["_grads"][loss], rtol=1e-10, atol=1e-12)
