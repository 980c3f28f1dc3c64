"""`unison check`: W=2 real processes vs 1 process on the global batch, and it can fail."""

import pytest

from unison.cli import main
from unison.equivalence import run_equivalence


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


# -- with real processes --

def test_simclr_exact_with_syncbn_and_gather():
    report = run_equivalence("simclr", world_size=2, steps=3)
    assert report.passed, report.summary()
    assert max(report.max_rel_loss, report.max_rel_grad, report.max_rel_state) < 1e-10
    assert report.ranks_identical


def test_check_fails_without_syncbn_or_gather(capsys):
    assert main(["check", "--method", "simclr", "--steps", "2", "--no-sync-batchnorm"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "sync_batchnorm=False" in out
    report = run_equivalence("simclr", world_size=2, steps=2, gather_distributed=False)
    assert not report.passed and report.max_rel_loss > 1e-3
    assert "gather is off" in report.summary()


# A change to the production step must make `unison check` fail: the check runs that step, not a copy.
def _record_with_per_rank_lr(spec_dict):
    """The production step with a per-rank learning rate (rank r steps with (1 + r) x the schedule's lr)."""
    from unison.distributed import collectives as C
    from unison.equivalence import record_steps
    from unison.training import step

    original = step.Schedule.lr
    step.Schedule.lr = lambda self, s: original(self, s) * (1 + C.rank())
    try:
        return record_steps(spec_dict)
    finally:
        step.Schedule.lr = original


def _record_with_world_dependent_schedule(spec_dict):
    """The production step with a schedule that wrongly depends on the world size (warm-up W times longer)."""
    from unison.distributed import collectives as C
    from unison.equivalence import record_steps
    from unison.training import step

    original = step.Schedule.lr
    step.Schedule.lr = lambda self, s: original(self, s // C.world_size())
    try:
        return record_steps(spec_dict)
    finally:
        step.Schedule.lr = original


def test_check_fails_when_the_production_step_changes():
    for broken in (_record_with_per_rank_lr, _record_with_world_dependent_schedule):
        report = run_equivalence("simclr", world_size=2, steps=3, record=broken)
        assert not report.passed, f"{broken.__name__}: {report.summary()}"
        assert report.max_rel_state > 1e-3, report.summary()


@pytest.mark.distributed
def test_check_passes_on_streamed_images_of_many_sizes_and_modes(tmp_path, capsys):
    from unison.data.generated import write_image_folder

    write_image_folder(tmp_path / "train", 40, classes=2, sizes=(16, 64), seed=4)
    assert main(["check", "--method", "simclr", "--steps", "3", "--image-size", "16",
                 "--data", str(tmp_path / "train")]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "streamed at 16 px" in out and "dtype=float64" in out


@pytest.mark.parametrize("shard, teacher, loss", [("none", None, "kl"), ("full", "vit_micro_p2", "kl"),
                                                 ("none", None, "dino"), ("full", "vit_micro_p2", "dino")])
def test_distill_check_passes_under_ddp_and_full_sharding(shard, teacher, loss):
    """`unison check --method distill` (its seeded random-init teacher; under --shard full a ViT teacher of another
    architecture than the student, sharded block by block; loss=dino: through the teacher's DINO head, sharded as
    a unit, with the all-reduced centre): the student's gradient is exact at W=2."""
    report = run_equivalence("distill", world_size=2, steps=2, shard=shard, teacher_backbone=teacher,
                             method_params={"loss": loss})
    assert report.passed and report.note is None, report.summary()


def test_frozen_blocks_check_passes_with_their_batch_norm_held():
    """--freeze 1 under MoCo (shuffle BN in the key encoder, a momentum copy of the frozen blocks): the frozen batch
    norms run on their running statistics at every rank, the step stays exact at W=2."""
    report = run_equivalence("moco", world_size=2, steps=2, freeze="1")
    assert report.passed and report.ranks_identical, report.summary()
