"""Every method at W=2 (real gloo processes, DDP, SyncBN, gather) equals one process on the global batch.

The runs use `unison.equivalence.record_steps`, i.e. exactly what `unison train` does: the
method built from one seed, `convert_sync_batchnorm`, `wrap_ddp`, SGD with momentum, views
from the method's augmentation preset with DIFFERENT data on each rank, float64, 3 steps
(EMAs, queues, centres, schedules and prototype freezing are exercised). All methods run
in ONE 2-process launch (each launch costs seconds), the references in one in-process run.

Comparison: loss (mean over ranks), DDP-averaged gradients and the full state after every
step, max |a - b| / scale < 1e-6 per tensor, where scale = max(max |b|, 1e-3 * the largest
entry of that step's dict). The floor matters for tensors whose exact gradient is zero
(a bias followed by batch norm: BYOL's projector output bias, DINO's head), where the
gradient is rounding noise (~1e-17) and a purely per-tensor relative difference is
meaningless.

The same launch also checks MoCo's queue semantics under DDP (with buffer broadcasting
ON, so a missing rank-local mark would show), the queue-size error, shuffle BN, and the
one-time broadcast of momentum networks built from different seeds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from unison.distributed.testing import run_in_workers
from unison.equivalence import max_rel_difference

WORLD = 2


LOCAL_BATCH = 8


STEPS = 3


TOL = 1e-6


# name -> (method, method_params, shared_queue)
CASES: dict[str, tuple[str, dict, bool]] = {
    "moco": ("moco", dict(proj_hidden_dim=16, proj_dim=8, queue_size=64, momentum=0.9), True),
    "byol": ("byol", dict(proj_hidden_dim=16, proj_dim=8, pred_hidden_dim=16, momentum_base=0.9), True),
    "simsiam": ("simsiam", dict(proj_hidden_dim=16, proj_dim=8, pred_hidden_dim=4), True),
    "barlowtwins": ("barlowtwins", dict(proj_hidden_dim=16, proj_dim=8, lambda_offdiag=0.05), True),
    "swav": ("swav", dict(proj_hidden_dim=16, proj_dim=8, n_prototypes=10, queue_length=16,
                          freeze_prototypes_steps=1), True),
    "swav_per_rank_queue": ("swav", dict(proj_hidden_dim=16, proj_dim=8, n_prototypes=10, queue_length=16), False),
    "vicreg": ("vicreg", dict(proj_hidden_dim=16, proj_dim=8), True),
    "dino": ("dino", dict(hidden_dim=16, bottleneck_dim=8, out_dim=32, momentum_base=0.9,
                          teacher_temp_warmup_fraction=0.5), True),
    # a seeded random-init small-CNN teacher; the queue (24) wraps within the 3 steps of 16 images
    "distill": ("distill", dict(queue_size=24), True),
    "distill_mse": ("distill", dict(loss="mse"), True),
    # the support set (32) wraps within the 3 steps of 16 images; TiCo's covariance runs over the 3 steps
    "nnclr": ("nnclr", dict(proj_hidden_dim=16, proj_dim=8, pred_hidden_dim=16, queue_size=32), True),
    "tico": ("tico", dict(proj_hidden_dim=16, proj_dim=8, momentum_base=0.9), True),
}


def _specs(world: int) -> dict[str, dict]:
    from unison.equivalence import CheckSpec

    out = {}
    for key, (method, params, shared) in CASES.items():
        spec = CheckSpec(method=method, world_size=WORLD, steps=STEPS, local_batch=LOCAL_BATCH, shared_queue=shared,
                         image_size=12, method_params=params)     # multicrop: 12 px global, 8 px local crops
        d = dataclasses.asdict(spec)
        if world == 1:
            d.update(world_size=1, local_batch=LOCAL_BATCH * WORLD)
        out[key] = d
    return out


# ------------------------------------------------------------------------------ workers
def _tiny_backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _moco_checks() -> dict:
    from unison.config.distributed import DistributedConfig
    from unison.distributed import collectives as C
    from unison.distributed.sync_batchnorm import GlobalBatchNorm, convert_sync_batchnorm
    from unison.methods import BYOL, BYOLParams, MoCo, MoCoParams
    from unison.methods.moco import shuffled_forward
    from unison.parallel.ddp import wrap_ddp

    cpu = torch.device("cpu")
    rows = C.local_slice(LOCAL_BATCH * WORLD)

    def views(step: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(LOCAL_BATCH * WORLD, 3, 8, 8, generator=g)[rows] for _ in range(2)]

    def moco(**kw) -> MoCo:
        torch.manual_seed(0)
        shared = kw.pop("shared_queue", True)
        return MoCo(_tiny_backbone(), 4, MoCoParams(proj_hidden_dim=8, proj_dim=4, **kw), shared_queue=shared,
                    steps_total=STEPS)

    def train(model: nn.Module, sync_bn: bool) -> nn.Module:
        if sync_bn:
            model = convert_sync_batchnorm(model, cpu)
        ddp = wrap_ddp(model, DistributedConfig(world_size=WORLD, sync_batchnorm=sync_bn), cpu)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(STEPS):
            loss = ddp(views(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.on_after_step(step)
        out["losses_finite"] = out.get("losses_finite", True) and bool(torch.isfinite(loss))
        return ddp

    out: dict = {}
    # Queues under DDP with buffer broadcasting ON (no SyncBN): marked rank-local, never overwritten.
    for shared in (False, True):
        ddp = train(moco(queue_size=64, shared_queue=shared), sync_bn=False)
        out[f"queue_shared={shared}"] = ddp.module.queue.clone()
        out[f"queue_ptr_shared={shared}"] = ddp.module.queue_ptr.clone()
        out["ddp_state_keys"] = sorted(ddp.state_dict())
    # Queue size vs the GLOBAL batch: 16 fits one process with batch 8 (2 x 8 keys), not 2 x 16 keys at W=2.
    try:
        moco(queue_size=16)(views(0))
        out["queue_error"] = ""
    except ValueError as e:
        out["queue_error"] = str(e)
    # Shuffle BN: permute / un-permute is exact for a batch-independent encoder ...
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    x = views(0)[0]
    with torch.no_grad():
        out["shuffle_max_err"] = float((shuffled_forward(enc, x, seed=123) - enc(x)).abs().max())
    # ... and with shuffle_bn the key encoder normalises per rank, the query encoder globally.
    ddp = train(moco(queue_size=64, shuffle_bn=True), sync_bn=True)
    m = ddp.module
    out["shuffle_key_bn_types"] = sorted({type(b).__name__ for b in m.key_encoder.backbone.modules()
                                          if isinstance(b, nn.modules.batchnorm._BatchNorm)})
    out["shuffle_key_running_mean"] = m.key_encoder.backbone[1].running_mean.clone()
    out["shuffle_query_running_mean"] = m.backbone[1].running_mean.clone()
    out["shuffle_query_is_global"] = isinstance(m.backbone[1], GlobalBatchNorm)
    out["shuffle_note"] = m.exactness_note() or ""
    # Momentum networks built from different seeds are made identical on the first forward.
    torch.manual_seed(1234 + C.rank())
    byol = convert_sync_batchnorm(BYOL(_tiny_backbone(), 4, BYOLParams(8, 4, 8), steps_total=STEPS), cpu)
    ddp = wrap_ddp(byol, DistributedConfig(world_size=WORLD), cpu)
    ddp(views(0))
    out["byol_online"] = torch.cat([p.detach().flatten() for p in byol.backbone.parameters()])
    out["byol_target"] = torch.cat([p.detach().flatten() for p in byol.target.backbone.parameters()])
    return out


def _distributed_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    out = {key: record_steps(spec) for key, spec in specs.items()}
    out["_moco"] = _moco_checks()
    return out


def _reference_worker(specs: dict[str, dict]) -> dict:
    from unison.equivalence import record_steps

    return {key: record_steps(spec) for key, spec in specs.items()}


@pytest.fixture(scope="module")
def runs():
    multi = run_in_workers(_distributed_worker, WORLD, args=(_specs(WORLD),), timeout_s=600)
    single = run_in_workers(_reference_worker, 1, args=(_specs(1),), backend="local")[0]
    return multi, single


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_equal_one_process(runs, case):
    multi, single = runs
    skip = ("queue",) if not CASES[case][2] else ()
    for r in range(WORLD):
        m, s = multi[r][case], single[case]
        assert len(m["losses"]) == len(s["losses"]) == STEPS
        for step in range(STEPS):
            ml, sl = float(m["losses"][step]), float(s["losses"][step])
            assert abs(ml - sl) <= TOL * abs(sl), f"step {step}: loss {ml} vs {sl}"
            d, k = max_rel_difference(m["grads"][step], s["grads"][step])
            assert d < TOL, f"rank {r} step {step}: gradient of {k} differs by {d:.2e}"
            d, k = max_rel_difference(m["states"][step], s["states"][step], skip)
            assert d < TOL, f"rank {r} step {step}: state {k} differs by {d:.2e}"
    # Per-rank queues differ between ranks by design, so the check leaves them out; the rest is identical.
    assert multi[0][case]["identical"], "the state differs between ranks"
    if not skip:
        assert multi[0][case]["note"] is None


@pytest.mark.slow
def test_shared_queue_state_is_exercised(runs):
    multi, single = runs
    moco = single["moco"]["states"][-1]
    assert int(moco["queue_ptr"]) == (STEPS * 2 * LOCAL_BATCH * WORLD) % 64 != 0     # wrapped around
    swav = single["swav"]["states"][-1]
    assert int(swav["queue_filled"]) == 16 and swav["queue"].abs().sum() > 0
    nnclr = single["nnclr"]["states"][-1]
    assert int(nnclr["queue_ptr"]) == (STEPS * LOCAL_BATCH * WORLD) % 32 != 0     # wrapped around
    for case in ("moco", "swav", "nnclr"):
        torch.testing.assert_close(multi[0][case]["states"][-1]["queue"], multi[1][case]["states"][-1]["queue"],
                                   rtol=0, atol=0)
    centre = single["dino"]["states"][-1]["loss_fn.center"]
    assert centre.abs().sum() > 0
    assert single["tico"]["states"][-1]["loss_fn.covariance"].abs().sum() > 0


@pytest.mark.slow
def test_moco_queues_under_ddp(runs):
    multi, _ = runs
    a, b = multi[0]["_moco"], multi[1]["_moco"]
    assert a["losses_finite"] and b["losses_finite"]
    # per-rank queues: each rank kept its own keys although DDP broadcasts buffers every step
    assert not torch.equal(a["queue_shared=False"], b["queue_shared=False"])
    assert int(a["queue_ptr_shared=False"]) == int(b["queue_ptr_shared=False"]) == (STEPS * 2 * LOCAL_BATCH) % 64
    # shared queue: bitwise identical on both ranks
    torch.testing.assert_close(a["queue_shared=True"], b["queue_shared=True"], rtol=0, atol=0)
    assert int(a["queue_ptr_shared=True"]) == (STEPS * 2 * LOCAL_BATCH * WORLD) % 64
    # queue and pointer are part of the (DDP-wrapped) state dict, i.e. of checkpoints
    assert {"module.queue", "module.queue_ptr"} <= set(a["ddp_state_keys"])


@pytest.mark.slow
def test_moco_queue_size_error_uses_the_global_batch(runs):
    msg = runs[0][0]["_moco"]["queue_error"]
    assert "queue_size=16" in msg and "32 keys" in msg and "global batch 16 = 8 per rank x 2 ranks" in msg
    assert "\n" not in msg


@pytest.mark.slow
def test_moco_shuffle_bn(runs):
    a, b = runs[0][0]["_moco"], runs[0][1]["_moco"]
    assert a["shuffle_max_err"] < 1e-6 and b["shuffle_max_err"] < 1e-6
    assert a["shuffle_key_bn_types"] == ["_LocalBatchNorm"]          # key encoder: per-rank BN
    assert a["shuffle_query_is_global"]                              # query encoder: still SyncBN
    assert not torch.equal(a["shuffle_key_running_mean"], b["shuffle_key_running_mean"])
    torch.testing.assert_close(a["shuffle_query_running_mean"], b["shuffle_query_running_mean"], rtol=0, atol=0)
    assert "shuffle_bn" in a["shuffle_note"]


@pytest.mark.slow
def test_momentum_network_is_broadcast_once(runs):
    a, b = runs[0][0]["_moco"], runs[0][1]["_moco"]
    torch.testing.assert_close(a["byol_online"], b["byol_online"], rtol=0, atol=0)     # DDP's own broadcast
    torch.testing.assert_close(a["byol_target"], b["byol_target"], rtol=0, atol=0)     # ours, from rank 0
    torch.testing.assert_close(a["byol_target"], a["byol_online"], rtol=0, atol=0)     # rank 0's copy of online
