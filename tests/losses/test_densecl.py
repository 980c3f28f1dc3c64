"""DenseCL's loss (single process, float64): against Lightly's pieces for DenseCL (``select_most_similar`` and
``NTXentLoss`` over a memory bank holding the same queue; values and gradients), against a loop-level restatement of
its formula, its matching, and its weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from unison.losses import DenseCLLoss, MoCoLoss
from unison.losses.densecl import most_similar_cells


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs(n=4, s=5, d=6, c=7, k=9):
    return dict(q=_rand(n, d, seed=1), k=_rand(n, d, seed=2), queue=F.normalize(_rand(k, d, seed=3), dim=1),
                q_dense=_rand(n, s, d, seed=4), k_dense=_rand(n, s, d, seed=5), q_features=_rand(n, s, c, seed=6),
                k_features=_rand(n, s, c, seed=7), dense_queue=F.normalize(_rand(k, d, seed=8), dim=1))


def _lightly_bank(loss, queue: torch.Tensor) -> None:
    """Fill a Lightly NTXentLoss's memory bank with `queue` [K, d] (what it scores against before it enqueues)."""
    loss.memory_bank.bank = queue.clone()
    loss.memory_bank.bank_ptr.zero_()


def test_densecl_loss_equals_lightlys_pieces_with_their_gradients():
    lightly_loss = pytest.importorskip("lightly.loss")
    lightly_utils = pytest.importorskip("lightly.models.utils")
    x = _inputs()
    ours_in = {name: t.clone().requires_grad_(name in ("q", "q_dense")) for name, t in x.items()}
    theirs_in = {name: t.clone().requires_grad_(name in ("q", "q_dense")) for name, t in x.items()}
    ours = DenseCLLoss(temperature=0.2, loss_lambda=0.5)(**ours_in)
    k_queue, d = x["queue"].shape
    global_loss = lightly_loss.NTXentLoss(temperature=0.2, memory_bank_size=(k_queue, d))
    local_loss = lightly_loss.NTXentLoss(temperature=0.2, memory_bank_size=(k_queue, d))
    _lightly_bank(global_loss, x["queue"])
    _lightly_bank(local_loss, x["dense_queue"])
    t = theirs_in
    key_local = lightly_utils.select_most_similar(t["q_features"], t["k_features"], t["k_dense"])
    theirs = 0.5 * (global_loss(t["q"], t["k"]) + local_loss(t["q_dense"].flatten(end_dim=1), key_local.flatten(end_dim=1)))
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-9 * abs(float(theirs.detach()))
    ours.backward()
    theirs.backward()
    for name in ("q", "q_dense"):
        torch.testing.assert_close(ours_in[name].grad, theirs_in[name].grad, rtol=1e-9, atol=1e-12)


def test_densecl_loss_matches_its_formula():
    x, t, lam = _inputs(n=3, s=4, d=3, c=2, k=5), 0.2, 0.3

    def infonce(q, k, queue):
        q, k = q / q.norm(), k / k.norm()
        pos = math.exp(float(q @ k) / t)
        return -math.log(pos / (pos + sum(math.exp(float(q @ neg) / t) for neg in queue)))

    def cos(u, v):
        return float(u @ v / (u.norm() * v.norm()))

    n, s = x["q_dense"].shape[:2]
    glob = sum(infonce(x["q"][i], x["k"][i], x["queue"]) for i in range(n)) / n
    dense = 0.0
    for i in range(n):
        for cell in range(s):
            best = max(range(s), key=lambda j: cos(x["q_features"][i, cell], x["k_features"][i, j]))
            dense += infonce(x["q_dense"][i, cell], x["k_dense"][i, best], x["dense_queue"]) / (n * s)
    expected = (1 - lam) * glob + lam * dense
    got = float(DenseCLLoss(temperature=t, loss_lambda=lam)(**x))
    assert abs(got - expected) <= 1e-10 * abs(expected)


def test_densecl_matches_each_cell_to_the_most_similar_cell_of_its_own_image():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0], [0.0, -1.0]]])
    queries = torch.tensor([[[0.1, 2.0], [3.0, 0.2]], [[3.0, 0.2], [0.0, -0.5]]])
    assert most_similar_cells(queries, keys).tolist() == [[1, 0], [1, 2]]


def test_densecl_loss_weights_and_its_warm_up_lambda():
    x = _inputs()
    glob = MoCoLoss(0.2)(x["q"], x["k"], x["queue"])
    torch.testing.assert_close(DenseCLLoss(0.2, 0.5)(**x, loss_lambda=0.0), glob)
    torch.testing.assert_close(DenseCLLoss(0.2, 0.0)(**x), glob)
    only_dense = DenseCLLoss(0.2, 1.0)(**x)
    torch.testing.assert_close(DenseCLLoss(0.2, 0.25)(**x), 0.75 * glob + 0.25 * only_dense)
    with pytest.raises(ValueError, match="dense projections"):
        DenseCLLoss()(**{**x, "q_dense": x["q_dense"][:, :, :2]})
