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


@pytest.mark.parametrize("deterministic", [False, True])
def test_cudnn_times_its_algorithms_unless_the_run_is_deterministic(deterministic, monkeypatch):
    """Fixed shapes: cuDNN's timed choice is paid once; --deterministic keeps torch's repeatable one."""
    from unison.training.model import build_method

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", deterministic)   # the opposite of what it must become
    cfg = TrainConfig(method="simclr", data="synthetic", batch_size=4, max_steps=1, deterministic=deterministic)
    try:
        build_method(cfg, 1, torch.float32, torch.device("cpu"), image_size=16)
        assert torch.backends.cudnn.benchmark is not deterministic
    finally:
        torch.use_deterministic_algorithms(False)   # process-wide: the tests after this one run as usual
