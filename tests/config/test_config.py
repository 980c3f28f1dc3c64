"""Configuration validation: every error is one line that says what to fix; nothing starts."""

import pytest

from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import ConfigError


@pytest.mark.parametrize("kwargs, fragment", [
    ({"rank": 2, "world_size": 2}, "outside [0, world_size=2)"),
    ({"rank": -1}, "outside [0"),
    ({"world_size": 0}, "must be an integer >= 1"),
    ({"backend": "nccl"}, "needs CUDA"),
    ({"backend": "gloo", "grad_compression": "bf16"}, "needs CUDA + NCCL"),
    ({"backend": "tcp"}, "unknown; use one of auto, local, gloo, nccl, mpi"),
    ({"backend": "local", "world_size": 2}, "use --world-size 1"),
    ({"grad_sync_every": 0}, "grad_sync_every=0 must be"),
    ({"accumulation": "sum"}, "accumulation='sum' is unknown; use one of exact, independent"),
    ({"grad_compression": "zip"}, "grad_compression='zip' is unknown"),
    ({"grad_compression": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter=1 must be an integer >= 2"),
    ({"grad_compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank=0 must be an integer >= 1"),
    ({"master_port": 70000}, "master_port=70000"),
    ({"timeout_s": 0}, "timeout_s=0 must be a finite number >= 1"),
    ({"shard": "zero3"}, "shard='zero3' is unknown"),
    ({"shard": "full", "grad_compression": "fp16"}, "is a DDP communication hook"),
    ({"shard": "full", "find_unused_parameters": True}, "find_unused_parameters is a DDP option"),
])
def test_distributed_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        DistributedConfig(**kwargs).validate(cuda_available=False)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_distributed_config_round_trip_and_unknown_keys():
    cfg = DistributedConfig(backend="gloo", world_size=4, rank=3, grad_compression="powersgd", shard="optimizer")
    assert DistributedConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown distributed option.*world_sise"):
        DistributedConfig.from_dict({"world_sise": 2})


def test_bf16_accepted_with_nccl_and_cuda():
    DistributedConfig(backend="nccl", grad_compression="bf16").validate(cuda_available=True)
    assert DistributedConfig(world_size=2).resolved_backend(cuda_available=True) == "nccl"
    assert DistributedConfig(world_size=2).resolved_backend(cuda_available=False) == "gloo"
    assert DistributedConfig(world_size=1).resolved_backend(cuda_available=False) == "local"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"amp": "fp16"}, "use --amp bf16"),
    ({"method": "moco", "method_params": {"shuffle_bn": True}}, "MoCo shuffle_bn"),
])
def test_full_sharding_refuses_what_it_cannot_do(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs, distributed=DistributedConfig(shard="full")).validate(cuda_available=True)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    TrainConfig(**kwargs).validate(cuda_available=True)   # fine without full sharding


def test_shard_optimizer_flag_is_an_alias():
    from unison.cli import make_parser
    from unison.cli.train_args import build_train_config

    assert build_train_config(make_parser().parse_args(["train", "--shard-optimizer"])).distributed.shard == "optimizer"
    assert build_train_config(make_parser().parse_args(["train", "--shard", "full"])).distributed.shard == "full"
    # configs and checkpoints written before `shard` existed
    assert DistributedConfig.from_dict({"shard_optimizer": True}).shard == "optimizer"
    assert DistributedConfig.from_dict({"shard_optimizer": False, "shard": "full"}).shard == "full"
    assert DistributedConfig(shard="optimizer").shard_optimizer and not DistributedConfig(shard="full").shard_optimizer
    with pytest.raises(ConfigError, match="contradicts"):
        DistributedConfig.from_dict({"shard_optimizer": True, "shard": "full"})


@pytest.mark.parametrize("kwargs, fragment", [
    ({"method": "mocov9"}, "method='mocov9' is unknown"),
    ({"batch_size": 255}, "cannot be split evenly over world_size=2"),
    ({"epochs": 0}, "epochs=0 must be an integer >= 1"),
    ({"lr": -1.0}, "lr=-1.0 must be a finite number"),
    ({"lr": 0.0}, "lr=0 would not train"),
    ({"amp": "fp8"}, "amp='fp8' is unknown"),
    ({"knn_k": 0}, "knn_k=0 must be"),
    ({"optimizer": "rmsprop"}, "optimizer='rmsprop' is unknown"),
    ({"method_params": {"temprature": 0.1}}, "unknown simclr parameter(s) 'temprature' (did you mean"),
    ({"subset": 0}, "subset=0 must be an integer >= 1"),
])
def test_train_config_errors(kwargs, fragment):
    """`validate_run`: the fields (`TrainConfig.validate`) and the names of the layers above (method, params)."""
    from unison.training.resolve import validate_run

    with pytest.raises(ConfigError) as info:
        validate_run(TrainConfig(**kwargs), cuda_available=False)
    assert fragment in str(info.value)


def test_train_config_round_trip():
    cfg = TrainConfig(method="simclr", epochs=3, distributed=DistributedConfig(world_size=4, shard="full"))
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown option"):
        TrainConfig.from_dict({"epoch": 3})

