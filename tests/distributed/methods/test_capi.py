"""CAPI's pieces at W=2 (real gloo processes) against one process on the global batch: the positionwise Sinkhorn
targets are the rows of the single-process targets (the shift a global maximum, the sums global), both losses and
their gradients averaged over ranks as DDP does equal the single-process ones, and each rank's inverse block masks
are the rows of one process's. The whole method: ``unison check --method capi`` (tests/helpers/every_method.py)."""

from __future__ import annotations

import pytest
import torch

from unison.distributed.testing import run_in_workers

pytestmark = pytest.mark.distributed

INDICES = torch.tensor([31, 4, 17, 99, 2, 56, 8, 1000])


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 6, 5, generator=g, dtype=torch.float64) * 4
    teacher[5:] += 9.0              # the second rank's maxima lie above the first's: the shift must be global
    student = torch.randn(8, 3, 5, generator=g, dtype=torch.float64)
    predicted = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(8)])
    return teacher, student, predicted


def _worker() -> dict[str, torch.Tensor]:
    from unison.distributed import collectives as C
    from unison.losses import CAPILoss, positionwise_sinkhorn
    from unison.methods import SampleKeys
    from unison.methods.masking import inverse_block_masking

    rows = C.local_slice(8)
    teacher, student, predicted = (x[rows] for x in _inputs())
    t, s = teacher.clone().requires_grad_(True), student.clone().requires_grad_(True)
    capi, clust = CAPILoss()(t, s, predicted)
    (capi + 2 * clust).backward()           # DDP averages the ranks' gradients: each rank's own rows, / W
    keys = SampleKeys(seed=5, epoch=1, indices=INDICES[rows])
    return {"targets": positionwise_sinkhorn(teacher / 0.06), "capi": C.all_reduce_no_grad(capi, average=True),
            "clust": C.all_reduce_no_grad(clust, average=True), "t_grad": t.grad / C.world_size(),
            "s_grad": s.grad / C.world_size(), "visible": inverse_block_masking(keys, 3, 8, 41)[0]}


def test_capi_pieces_at_two_ranks_equal_one_process():
    multi = run_in_workers(_worker, 2)
    single = run_in_workers(_worker, 1, backend="local")[0]
    for key in ("targets", "t_grad", "s_grad", "visible"):
        torch.testing.assert_close(torch.cat([multi[0][key], multi[1][key]]), single[key], rtol=1e-12, atol=1e-12,
                                   msg=key)
    for key in ("capi", "clust"):
        for r in (0, 1):
            torch.testing.assert_close(multi[r][key], single[key], rtol=1e-12, atol=1e-12, msg=key)
