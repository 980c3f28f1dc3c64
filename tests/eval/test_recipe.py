"""The fine-tuning and standard linear recipes (`unison.eval.recipe`): the papers' defaults, overrides, checks."""

import pytest

from unison.errors import ConfigError
from unison.eval.recipe import resolve_recipe


def test_the_defaults_are_the_papers():
    vit = resolve_recipe("fine-tune", "vit", {})
    assert (vit.optimizer, vit.base_lr, vit.weight_decay, vit.layer_decay, vit.warmup_epochs, vit.drop_path,
            vit.label_smoothing, vit.epochs, vit.head_init_std) == ("adamw", 5e-4, 0.05, 0.65, 5.0, 0.1, 0.1, 100, 2e-5)
    cnn = resolve_recipe("fine-tune", "cnn", {})
    assert (cnn.optimizer, cnn.base_lr, cnn.weight_decay, cnn.warmup_epochs, cnn.epochs) == ("sgd", 0.05, 0.0, 0.0, 60)
    linear = resolve_recipe("linear", "vit", {})
    assert (linear.optimizer, linear.base_lr, linear.head_norm, linear.drop_path, linear.epochs) == ("sgd", 0.1, True,
                                                                                                    0.0, 100)


def test_given_values_win_and_the_rate_scales_with_the_global_batch():
    r = resolve_recipe("fine-tune", "vit", {"epochs": 3, "batch_size": 128, "base_lr": None, "mixup": 0.8})
    assert (r.epochs, r.batch_size, r.mixup, r.warmup_epochs) == (3, 128, 0.8, 0.15)   # MAE: 5 of 100 epochs
    assert r.lr == pytest.approx(5e-4 * 128 / 256)
    assert r.as_dict()["lr"] == r.lr and r.as_dict()["source"].startswith("MAE")


@pytest.mark.parametrize("protocol, given, match", [
    ("fine-tune", {"optimizer": "lamb"}, "--optimizer"),
    ("fine-tune", {"layer_decay": 1.5}, "--layer-decay"),
    ("fine-tune", {"epochs": 2, "warmup_epochs": 3}, "--warmup-epochs"),
    ("fine-tune", {"base_lr": 0}, "--lr"),
    ("fine-tune", {"epochs": 2.5}, "--epochs"),
    ("linear", {"drop_path": 0.1}, "frozen"),
])
def test_bad_values_are_one_line(protocol, given, match):
    with pytest.raises(ConfigError, match=match):
        resolve_recipe(protocol, "cnn", given)
