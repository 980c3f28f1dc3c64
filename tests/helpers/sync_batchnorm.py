"""Helpers shared by the unit and distributed tests of test_sync_batchnorm."""

import torch
import torch.nn as nn

G = torch.Generator().manual_seed(3)


# Per case: the global input (a shift and scale that plain batch norm must remove) and an asymmetric
# upstream gradient. "2d" is a conv feature map, "1d" a projection head's [N, C], "2d_channels_last" the
# memory format a channels-last run feeds in.
CASES = {
    "2d": (torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64) * 3 + 1.5,
           torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64)),
    "1d": (torch.randn(10, 4, generator=G, dtype=torch.float64) * 2 - 0.7,
           torch.randn(10, 4, generator=G, dtype=torch.float64)),
}


CASES["2d_channels_last"] = tuple(t.contiguous(memory_format=torch.channels_last) for t in CASES["2d"])


def _model(dim: int = 4) -> nn.Module:
    torch.manual_seed(0)
    bn = (nn.BatchNorm2d(4, momentum=0.3) if dim == 4 else nn.BatchNorm1d(4, momentum=0.3)).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn
