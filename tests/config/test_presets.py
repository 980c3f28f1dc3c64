"""``--preset speedrun``: it fills the options a run does not give; flags, YAML and nested values given win."""

import pytest
import torch

from unison.cli.train_args import parse_train_args
from unison.config import TrainConfig, presets
from unison.config.presets import preset_values
from unison.errors import ConfigError


def test_speedrun_fills_what_is_not_given():
    cfg = TrainConfig.from_dict({"preset": "speedrun", "backbone": "small_cnn", "method_params": {"proj_dim": 64}})
    here = preset_values("speedrun", cuda=torch.cuda.is_available())   # this machine's values
    assert (cfg.method, cfg.backbone, cfg.batch_size, cfg.data_mode, cfg.time_budget) == (
        "simclr", "small_cnn", here["batch_size"], "memory", "5m")
    assert cfg.method_params == {"temperature": here["method_params"]["temperature"], "proj_dim": 64}
    assert not (cfg.online_probe or cfg.random_init_knn or cfg.signal_images)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg   # a run's config.json (every option given) stays itself


def test_speedrun_from_the_command_line(tmp_path):
    cfg = parse_train_args(["--preset", "speedrun", "--batch-size", "64", "--time-budget", "90s", "--param",
                            "temperature=0.3", "--out", str(tmp_path)])
    here = preset_values("speedrun", cuda=torch.cuda.is_available())
    assert (cfg.batch_size, cfg.time_budget, cfg.backbone) == (64, "90s", here["backbone"])
    assert cfg.method_params["temperature"] == 0.3


def test_epochs_given_replace_the_presets_time_budget(tmp_path, recwarn):
    """``--preset speedrun --epochs 200``: 200 epochs of the recipe (e.g. against a published 200-epoch figure),
    not the preset's 5 minutes; a budget given beside them still wins, with the warning that epochs go unused."""
    cfg = parse_train_args(["--preset", "speedrun", "--epochs", "200", "--out", str(tmp_path)])
    assert (cfg.epochs, cfg.time_budget, cfg.method, cfg.data_mode) == (200, None, "simclr", "memory")
    assert not [w for w in recwarn if "is not used" in str(w.message)]
    assert TrainConfig.from_dict(cfg.to_dict()).time_budget is None   # resumed: still no budget
    with pytest.warns(UserWarning, match="epochs=200 is not used"):
        cfg = parse_train_args(["--preset", "speedrun", "--epochs", "200", "--time-budget", "2m", "--out",
                                str(tmp_path)])
    assert (cfg.epochs, cfg.time_budget) == (200, "2m")


def test_a_time_budget_that_is_not_one_is_refused_before_any_warning(tmp_path, recwarn):
    with pytest.raises(ConfigError, match="--time-budget 'none' is not a duration"):
        parse_train_args(["--time-budget", "none", "--epochs", "3", "--out", str(tmp_path)])
    assert not [w for w in recwarn if "is not used" in str(w.message)]


def test_speedrun_on_a_gpu_adds_bf16_only_there_and_never_compiles():
    # compile: 42 s of start-up against 3 s eager on an H100, and no faster step (the presets' docstring)
    assert preset_values("speedrun", cuda=True)["amp"] == "bf16"
    assert "amp" not in preset_values("speedrun", cuda=False)
    assert not preset_values("speedrun", cuda=True).get("compile")


def test_speedrun_on_a_cpu_compiles_where_a_compiler_is_found_and_takes_the_values_tuned_there(monkeypatch, tmp_path):
    # compile: 1.16x the CPU step for about 9 s of start-up (the presets' docstring); inductor needs a C++ compiler
    # and Python's headers
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(presets.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "clang++" else None)
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "Python.h").touch()
    monkeypatch.setattr(presets.sysconfig, "get_paths", lambda: {"include": str(headers)})
    assert preset_values("speedrun", cuda=False)["compile"] is True
    (headers / "Python.h").unlink()   # a compiler without Python's headers (no python3-dev) fails at the first step
    assert "compile" not in preset_values("speedrun", cuda=False)
    (headers / "Python.h").touch()
    monkeypatch.setattr(presets.shutil, "which", lambda name: None)
    assert "compile" not in preset_values("speedrun", cuda=False)
    cpu, gpu = preset_values("speedrun", cuda=False), preset_values("speedrun", cuda=True)
    assert (cpu["lr"], cpu["augmentation"], cpu["method_params"]) == (0.45, "mocov2", {"temperature": 0.2})
    # the model and batch the CPU values were chosen with: a ResNet-18 step takes 10 s on 2 cores
    assert (cpu["backbone"], cpu["batch_size"], gpu["backbone"], gpu["batch_size"]) == (
        "small_cnn", 256, "resnet18", 512)
    # one set of values, chosen on the CPU at 5 minutes and on a 100-epoch proxy of the GPU's regime
    assert (gpu["lr"], gpu["augmentation"], gpu["method_params"]) == (0.45, "mocov2", {"temperature": 0.2})
    # kNN against every training image, comparable with published kNN figures: a second on a GPU, minutes on a CPU
    assert preset_values("speedrun", cuda=True)["knn_reference"] == 0
    assert "knn_reference" not in preset_values("speedrun", cuda=False)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset 'fast' is unknown; use one of speedrun"):
        TrainConfig.from_dict({"preset": "fast"})


def test_unison_plan_takes_the_gpu_values_on_a_machine_without_one():
    # plan simulates a GPU job: on this CPU it had planned the CPU values (small CNN, batch 256) and refused their
    # --compile ("unison plan does not simulate --compile; leave it off") though the user never gave it
    from unison.cli import make_parser
    from unison.cli.train_args import build_train_config

    ns = make_parser("plan").parse_args(["plan", "--preset", "speedrun"])
    cfg = build_train_config(ns, cuda_available=True)
    assert (cfg.backbone, cfg.batch_size, cfg.amp, cfg.compile) == ("resnet18", 512, "bf16", False)
    assert TrainConfig.from_dict({"preset": "speedrun"}, cuda_available=False).backbone == "small_cnn"


@pytest.mark.parametrize("method", ["byol", "mae"])
def test_speedrun_with_another_method_leaves_out_simclrs_parameters_and_says_so(method, tmp_path):
    """The preset's temperature is SimCLR's: with --method byol it was refused as 'unknown byol parameter(s)
    'temperature'', a value the user never gave."""
    with pytest.warns(UserWarning) as caught:
        cfg = parse_train_args(["--preset", "speedrun", "--method", method, "--out", str(tmp_path)])
    lines = [str(w.message) for w in caught if "--preset speedrun" in str(w.message)]
    assert lines == [f"--preset speedrun's simclr parameter(s) temperature=0.2 are not applied to --method {method}; "
                     "give that method's own with --param NAME=VALUE"]
    assert cfg.method == method and "temperature" not in cfg.method_params and cfg.data_mode == "memory"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a run's config.json (every option given): filled and said before
        assert TrainConfig.from_dict(cfg.to_dict()) == cfg
        simclr = parse_train_args(["--preset", "speedrun", "--method", "simclr", "--out", str(tmp_path)])
    assert simclr.method_params == {"temperature": 0.2}
