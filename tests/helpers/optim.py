"""Helpers shared by the unit and distributed tests of test_optim."""

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from unison.distributed import collectives as C

DIM = 6


_g = torch.Generator().manual_seed(123)


X = torch.randn(8, DIM, generator=_g, dtype=torch.float64)  # global batch: rows 0-3 rank 0, rows 4-7 rank 1


Y = torch.randn(8, DIM, generator=_g, dtype=torch.float64)


class Net(nn.Module):
    """Four equal Linear layers, plus `extra` (used only by rank 1's loss) and `unused` (never used)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(4):
            layers += [nn.Linear(DIM, DIM, dtype=torch.float64)] + ([nn.Tanh()] if i < 3 else [])
        self.body = nn.Sequential(*layers)
        self.extra = nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
        self.unused = nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
        g = torch.Generator().manual_seed(7)  # identical start on every rank, whatever torch's seed
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)


def body_loss(net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net.body(x) - y) ** 2).sum(1).mean()  # mean over the rows given


def extra_term(net: Net, x: torch.Tensor) -> torch.Tensor:
    return (net.extra * x.mean(0)).sum()


def local_loss(net: Net, use_extra: bool = True) -> torch.Tensor:
    rows = C.local_slice(X.shape[0])
    loss = body_loss(net, X[rows], Y[rows])
    return loss + extra_term(net, X[rows]) if use_extra and C.rank() == 1 else loss


def global_loss(net: Net, use_extra: bool = True) -> torch.Tensor:
    # Mean of the ranks' local losses: body over the whole batch, `extra` from rank 1 only.
    loss = body_loss(net, X, Y)
    return loss + 0.5 * extra_term(net, X[4:]) if use_extra else loss


def vec(net: nn.Module) -> torch.Tensor:
    return parameters_to_vector(net.parameters()).detach().clone()


def train(net: Net, opt, steps: int, loss_fn=local_loss) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(net).backward()
        opt.step()
