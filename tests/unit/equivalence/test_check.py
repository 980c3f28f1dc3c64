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


def test_check_keeps_the_local_crops_that_swav_and_dino_drop_at_small_sizes():
    """The check's images are 16 px, where SwAV and DINO train 2 views by default: it checks their local-crop path."""
    from unison.equivalence import CheckSpec, train_config_for
    from unison.training.resolve import data_spec, resolve_recipe

    for method in ("swav", "dino"):
        cfg = train_config_for(CheckSpec(method=method), world_size=2)
        assert data_spec(cfg, resolve_recipe(cfg, 16)).local_crops == 4, method
    assert train_config_for(CheckSpec(method="simclr"), world_size=2).local_crops is None


def test_check_takes_a_list_of_methods_and_names_an_unknown_one(capsys):
    import pytest

    from unison.equivalence import check_methods as _check_methods
    from unison.errors import ConfigError
    from unison.methods import METHODS

    assert _check_methods("swav, dino,swav", METHODS) == ["swav", "dino"]
    assert _check_methods("all", METHODS) == sorted(METHODS)
    with pytest.raises(ConfigError, match=r"--method 'swv' is unknown \(did you mean 'swav'\?\)"):
        _check_methods("simclr,swv", METHODS)   # was a ValueError traceback
    with pytest.raises(ConfigError, match="--method is empty"):
        _check_methods(" , ", METHODS)
