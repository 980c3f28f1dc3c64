"""channels_last where it has fast kernels (float32, bf16), NCHW for float64, which has none."""

import pytest
import torch
from torch import nn

from unison.config import DistributedConfig, TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.training.step import build_run


@pytest.mark.parametrize("precision, nhwc", [("float32", True), ("float64", False)])
def test_float64_runs_keep_nchw_whatever_channels_last_says(precision, nhwc):
    """On the CPU a float64 convolution has no channels_last kernel: NHWC ran the small CNN's step 11x slower."""
    cfg = TrainConfig(method="simclr", data="synthetic", batch_size=4, max_steps=1, precision=precision, threads=1,
                      channels_last=True, distributed=DistributedConfig(backend="local", world_size=1))
    assert cfg.nhwc is nhwc
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
        convs = [m.weight for m in run.method.modules() if isinstance(m, nn.Conv2d)]
        assert convs, "no convolution: the test would not see the memory format"
        assert all(w.is_contiguous(memory_format=torch.channels_last) is nhwc for w in convs)
        assert all(w.is_contiguous() is not nhwc for w in convs)
    finally:
        shutdown_distributed(None)   # one process: nothing to wait for
