"""`unison check`: W=2 real processes vs 1 process on the global batch, and it can fail."""




def test_check_uses_the_recipe_optimizer_and_schedule():
    """The check's configuration is unison train's: recipe optimizer (LARS for VICReg), warm-up, precision."""
    from unison.equivalence import CheckSpec, train_config_for
    from unison.training.resolve import resolve_recipe

    cfg = train_config_for(CheckSpec(method="vicreg"), world_size=2)
    assert resolve_recipe(cfg).optimizer == "lars"
    assert cfg.precision == "float64" and cfg.warmup_epochs > 0 and cfg.max_steps == 4



def test_check_on_cuda_refuses_full_sharding_before_any_worker_starts():
    """`--device cuda` runs the ranks over gloo on GPU 0; FSDP's collectives there killed both ranks on an H100."""
    import pytest

    from unison.config.check import CheckSpec
    from unison.equivalence.steps import validate_check_specs
    from unison.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        validate_check_specs([CheckSpec(device="cuda", shard="full")], cuda_available=True)
    assert "--device cpu" in str(info.value) and "\n" not in str(info.value)
    validate_check_specs([CheckSpec(device="cuda", shard="optimizer")], cuda_available=True)
    validate_check_specs([CheckSpec(device="cpu", shard="full")], cuda_available=False)
