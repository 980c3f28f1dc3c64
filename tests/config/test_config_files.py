"""``--config FILE.yaml``: every problem of the file in one message, a line each; a YAML 1.1 base-60 number
(``1:30``) is never silently a number, for any option."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.config.fields import base_type
from unison.config.files import Sexagesimal, load_yaml_text
from unison.config.problems import file_problems

TRAIN = "train"


@pytest.fixture(autouse=True)
def _no_training(monkeypatch):
    """Every case is refused before training: reaching `unison.api.train` fails it (no process starts here)."""
    import unison.api

    def refuse(*args, **kwargs):
        raise AssertionError("the bad input was not refused: training started")

    monkeypatch.setattr(unison.api, "train", refuse)


def _error(tmp_path, text: str, capfd) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code = main([TRAIN, "--config", str(path), "--world-size", "1", "--out", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert code == 2 and not (tmp_path / "run").exists(), err
    return err.splitlines()


def test_every_problem_of_a_file_is_reported_at_once(tmp_path, capfd):
    lines = _error(tmp_path, "world_size: 2\nlearning_rate: 0.1\nepochs: ten\ndistributed:\n  world_sise: 2\n"
                             "  epochs: 3\n  timeout_s: 1:00\nsubset: -4\namp: bf61\n", capfd)
    assert lines[0] == f"unison: error: config file {tmp_path / 'c.yaml'} has 8 problems; fix them all, then run again:"
    assert lines[1:] == [
        "  line 1: world_size belongs under 'distributed:' in a config file (distributed: {world_size: 2}); on the "
        "command line: --world-size",
        "  line 2: learning_rate is not an option (did you mean 'lr'?)",
        "  line 3: epochs='ten' must be an int",
        "  line 5: distributed.world_sise is not a distributed option (did you mean 'world_size'?)",
        "  line 6: distributed.epochs: epochs belongs at the top level of a config file, not under 'distributed:'",
        "  line 7: distributed.timeout_s: 1:00 is a base-60 number in YAML 1.1 (60), which unison does not read as a "
        "number: write the number itself, e.g. distributed.timeout_s: 60",
        "  line 8: subset=-4 must be an integer >= 1 and <= 2**40",
        "  line 9: amp='bf61' is unknown (did you mean 'bf16'?); use one of none, bf16, fp16",
    ]


@pytest.mark.parametrize("text, expected", [
    ("checkpoint_every: 1:00\n", "checkpoint_every: 1:00 is a base-60 number in YAML 1.1 (60), which unison does not "
     "read as a number: write steps as a number (checkpoint_every: 60) or a duration with units, quoted "
     "(checkpoint_every: \"1h\" or \"1m\")"),
    ("time_budget: 1:30\n", "time_budget: 1:30 is a base-60 number in YAML 1.1 (90), which unison does not read as a "
     "number: write the duration with units, quoted, e.g. time_budget: \"1h30m\" or \"1m30s\""),
    ("checkpoint_every: 2.5\n", "checkpoint_every=2.5 must be an integer >= 0 and <= 2**62 (steps; 0 = at the end of "
     "every epoch) or a duration such as 30s, 10m, 2h or 1h30m"),
])
def test_durations_and_steps_name_what_was_written_and_how_to_write_it(text, expected, tmp_path, capfd):
    lines = _error(tmp_path, text, capfd)
    assert len(lines) == 1 and lines[0].startswith(f"unison: error: config file {tmp_path / 'c.yaml'}: line 1: "
                                                   f"{expected}"), lines


def test_a_base_60_number_is_never_a_number_for_any_option():
    """Every option that takes a number, steps or a duration refuses ``1:30`` (YAML 1.1: 90); an option of free text
    (a path) keeps it as written."""
    assert load_yaml_text("a: 1:30") == {"a": "1:30"} and isinstance(load_yaml_text("1:30.5"), Sexagesimal)
    for cls, prefix in ((TrainConfig, ""), (DistributedConfig, "distributed.")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            data = load_yaml_text(f"{f.name}: 1:30")
            problems = file_problems({"distributed": data} if prefix else data)
            takes_number = base_type(hints[f.name]) in (int, float) or f.name in ("checkpoint_every", "time_budget")
            if takes_number:
                assert len(problems) == 1 and "is a base-60 number in YAML 1.1 (90)" in problems[0], (f.name, problems)
            else:
                assert not any("base-60" in p for p in problems), (f.name, problems)
    assert file_problems(load_yaml_text("out: 1:30\ntime_budget: 600\ncheckpoint_every: '1m'")) == []


def test_a_base_60_param_value_is_refused_in_one_line(capfd):
    assert main([TRAIN, "--param", "temperature=1:00", "--world-size", "1"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == ("unison: error: --param temperature=1:00 is a base-60 number in YAML 1.1 (60), which unison does not "
                   "read as a number: write the number itself, e.g. --param temperature=60, or quote the text: --param "
                   "'temperature=\"1:00\"'"), err
