"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    # Tiny tensors: intra-op threads only add synchronisation (badly so on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
