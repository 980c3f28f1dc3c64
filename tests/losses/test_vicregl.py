"""VICRegL's loss (single process, float64): against Lightly's ``VICRegLLoss`` (values and gradients), against a
loop-level restatement of its formula with every cell matched by feature distance (the official default, which
Lightly cannot express), its matching, its two criteria alone, and its precision under autocast."""

from __future__ import annotations

import pytest
import torch

from unison.losses import VICRegLLoss
from unison.losses.vicregl import nearest_matches


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _view(n, side, d, c, seed):
    """(z [n, d], map [n, side, side, c], grid of cell centres [n, side, side, 2]) with continuous locations."""
    z, m = _rand(n, d, seed=seed, scale=0.7), _rand(n, side, side, c, seed=seed + 1, scale=1.3)
    grid = torch.rand(n, side, side, 2, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64) * 32
    return z, m, grid


def _ours(views, **kw):
    return VICRegLLoss(**kw)([z for z, _, _ in views], [m.flatten(1, 2) for _, m, _ in views],
                             [g.flatten(1, 2) for _, _, g in views])


@pytest.mark.parametrize("local_views", [0, 2])
def test_vicregl_loss_equals_lightlys_with_its_gradients(local_views):
    lightly_loss = pytest.importorskip("lightly.loss")
    views = [_view(6, 5, 8, 6, seed) for seed in (10, 20)] + [_view(6, 3, 8, 6, seed) for seed in (30, 40)][:local_views]
    leaves = [[t.clone().requires_grad_(True) for t in v[:2]] + [v[2]] for v in views]
    theirs_in = [[t.clone().requires_grad_(True) for t in v[:2]] + [v[2]] for v in views]
    ours = _ours(leaves, l2_all_matches=False)
    glob, loc = theirs_in[:2], theirs_in[2:]
    theirs = lightly_loss.VICRegLLoss(num_matches=(20, 4))(
        [(z, m) for z, m, _ in glob], [g for *_, g in glob],
        [(z, m) for z, m, _ in loc] if loc else None, [g for *_, g in loc] if loc else None)
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-9 * abs(float(theirs.detach()))
    ours.backward()
    theirs.sum().backward()
    for mine, lightlys in zip(leaves, theirs_in):
        for a, b in zip(mine[:2], lightlys[:2]):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)


def _reference(views, alpha=0.75, lam=25.0, mu=25.0, nu=1.0, eps=1e-4, k=(20, 4)):
    """The formula of `unison.losses.vicregl`, cell by cell: all cells matched by feature distance, the k nearest
    pairs by location."""
    def var(x):   # x [N, K, C]
        return torch.relu(1 - torch.sqrt(x.var(dim=0) + eps)).mean()

    def cov(x):
        n, kk, c = x.shape
        total = 0.0
        for j in range(kk):
            xc = x[:, j] - x[:, j].mean(dim=0)
            m = xc.T @ xc / (n - 1)
            total = total + sum(m[a, b] ** 2 for a in range(c) for b in range(c) if a != b) / c
        return total / kk

    def local(x, y):
        return lam * ((x - y) ** 2).mean() + mu * (var(x) + var(y)) / 2 + nu * (cov(x) + cov(y)) / 2

    def match(xs, ys, dist, keep):   # xs [n, L, C]: each cell's nearest, the `keep` closest pairs by distance
        rows_x, rows_y = [], []
        for i in range(xs.shape[0]):
            pairs = sorted((min(dist[i][p]), p, min(range(ys.shape[1]), key=lambda q: dist[i][p][q]))
                           for p in range(xs.shape[1]))[:keep]
            rows_x.append(torch.stack([xs[i, p] for _, p, _ in pairs]))
            rows_y.append(torch.stack([ys[i, q] for _, _, q in pairs]))
        return torch.stack(rows_x), torch.stack(rows_y)

    z = [v[0] for v in views]
    m = [v[1].flatten(1, 2) for v in views]
    g = [v[2].flatten(1, 2) for v in views]
    pairs = [(a, b) for a in range(2) for b in range(len(views)) if b != a]
    inv = sum(((z[a] - z[b]) ** 2).mean() for a, b in pairs) / len(pairs)
    glob = lam * inv + mu * sum(var(x[:, None]) for x in z) / len(z) + nu * sum(cov(x[:, None]) for x in z) / len(z)
    loc_total = 0.0
    for a, b in pairs:
        feat = [[[float((m[a][i, p] - m[b][i, q]).norm()) for q in range(m[b].shape[1])]
                 for p in range(m[a].shape[1])] for i in range(m[a].shape[0])]
        place = [[[float((g[a][i, p] - g[b][i, q]).norm()) for q in range(g[b].shape[1])]
                  for p in range(g[a].shape[1])] for i in range(g[a].shape[0])]
        back = [[list(col) for col in zip(*rows)] for rows in feat]
        place_back = [[list(col) for col in zip(*rows)] for rows in place]
        l2 = local(*match(m[a], m[b], feat, m[a].shape[1])) + local(*match(m[b], m[a], back, m[b].shape[1]))
        by_place = local(*match(m[a], m[b], place, k[0])) + local(*match(m[b], m[a], place_back, k[1]))
        loc_total = loc_total + l2 / 2 + by_place / 2
    return alpha * glob + (1 - alpha) * loc_total / len(pairs)


def test_vicregl_loss_matches_its_formula_with_every_cell_matched_by_features():
    views = [_view(4, 3, 3, 3, seed) for seed in (1, 2)] + [_view(4, 2, 3, 3, 3)]
    expected = _reference(views, k=(5, 2))
    got = _ours(views, num_matches=5, num_matches_back=2)   # l2_all_matches=True: the official default
    assert abs(float(got) - float(expected)) <= 1e-10 * abs(float(expected))


def test_nearest_matches_keeps_the_closest_pairs_in_order_and_breaks_ties_by_cell():
    cells = torch.arange(5, dtype=torch.float64)[None, :, None]          # cell values 0..4 (1 image, 1 channel)
    candidates = torch.tensor([[[10.0], [20.0], [30.0]]], dtype=torch.float64)
    distances = torch.tensor([[[0.5, 2.0, 3.0], [4.0, 0.1, 5.0], [0.5, 9.0, 9.0], [7.0, 7.0, 0.2], [8.0, 6.0, 9.0]]],
                             dtype=torch.float64)
    x, y = nearest_matches(cells, candidates, distances, 3)
    assert x.flatten().tolist() == [1.0, 3.0, 0.0]      # distances 0.1, 0.2, then the first of the two 0.5
    assert y.flatten().tolist() == [20.0, 30.0, 10.0]   # each cell's nearest candidate
    assert nearest_matches(cells, candidates, distances, None)[0].shape == (1, 5, 1)   # all cells
    assert nearest_matches(cells, candidates, distances, 50)[0].shape == (1, 5, 1)


def test_vicregl_loss_with_one_criterion_needs_only_its_inputs():
    views = [_view(5, 3, 4, 4, seed) for seed in (1, 2)]
    z = [v[0] for v in views]
    m, g = [v[1].flatten(1, 2) for v in views], [v[2].flatten(1, 2) for v in views]
    both = VICRegLLoss(alpha=0.75)(z, m, g)
    only_global = VICRegLLoss(alpha=1.0)(z, None, None)
    only_local = VICRegLLoss(alpha=0.0)(None, m, g)
    torch.testing.assert_close(both, 0.75 * only_global + 0.25 * only_local, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="global embeddings"):
        VICRegLLoss(alpha=0.5)(None, m, g)
    with pytest.raises(ValueError, match="feature map and cell locations"):
        VICRegLLoss(alpha=0.5)(z, m, None)
    with pytest.raises(ValueError, match="at least 2 samples"):
        VICRegLLoss()([t[:1] for t in z], [t[:1] for t in m], [t[:1] for t in g])


def test_vicregl_loss_runs_in_float32_under_bf16_autocast():
    views = [_view(6, 3, 8, 8, seed) for seed in (1, 2)]
    z = [v[0].float().bfloat16() for v in views]
    m = [v[1].flatten(1, 2).float().bfloat16() for v in views]
    g = [v[2].flatten(1, 2) for v in views]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = VICRegLLoss()(z, m, g)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
