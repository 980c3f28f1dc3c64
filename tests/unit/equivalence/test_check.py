"""`unison check`: W=2 real processes vs 1 process on the global batch, and it can fail."""




def test_check_uses_the_recipe_optimizer_and_schedule():
    """The check's configuration is unison train's: recipe optimizer (LARS for VICReg), warm-up, precision."""
    from unison.equivalence import CheckSpec, train_config_for
    from unison.training.resolve import resolve_recipe

    cfg = train_config_for(CheckSpec(method="vicreg"), world_size=2)
    assert resolve_recipe(cfg).optimizer == "lars"
    assert cfg.precision == "float64" and cfg.warmup_epochs > 0 and cfg.max_steps == 4
