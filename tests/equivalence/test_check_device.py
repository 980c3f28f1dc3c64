"""``unison check --device cuda`` where torch sees no GPU: one line before any worker starts."""

from __future__ import annotations

import pytest
import torch

from unison.equivalence.steps import run_equivalence
from unison.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: tests/gpu runs the check on it")
def test_check_on_cuda_without_a_gpu_is_one_line():
    with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA device here"):
        run_equivalence("simclr", 2, device="cuda")
