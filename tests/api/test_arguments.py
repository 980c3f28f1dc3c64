"""The Python API's arguments: every public function of `unison` (`dir(unison)`) checks each call against its
signature before it runs (`unison.api.checked`), so a wrong type, an unknown keyword or a nested configuration
given as a dict is one `unison.errors` line naming the argument and what it takes, never a raw `TypeError` or
`AttributeError` from deep inside. In process: nothing here starts a worker or reads data."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import unison
from unison.api import _alternatives
from unison.config import DistributedConfig, TrainConfig
from unison.errors import ConfigError

FUNCTIONS = [name for name in dir(unison) if callable(getattr(unison, name))]


def _valid(annotation: str):
    """A value of the first type `annotation` names (what a required argument gets while another one is tested)."""
    first = _alternatives(annotation)[0]
    return {"str": "runs/none", "int": 1, "bool": True, "TrainConfig": TrainConfig()}.get(first, Path("runs/none"))


def _required(fn, but: str) -> dict:
    return {n: _valid(p.annotation) for n, p in inspect.signature(fn).parameters.items()
            if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != but}


def test_every_public_function_checks_its_arguments():
    assert set(FUNCTIONS) == set(unison.API)
    assert all(getattr(unison, name).__dict__.get("checked") for name in FUNCTIONS)


@pytest.mark.parametrize("name, param", [(f, p) for f in FUNCTIONS
                                          for p, q in inspect.signature(getattr(unison, f)).parameters.items()
                                          if q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)
                                          and "Any" not in _alternatives(q.annotation)])
def test_a_value_of_another_type_names_the_argument(name, param):
    fn = getattr(unison, name)
    with pytest.raises(ConfigError, match=rf"^unison\.{name}: {param}=<object object at .*> \(object\) must be "):
        fn(**_required(fn, but=param), **{param: object()})


@pytest.mark.parametrize("name", FUNCTIONS)
def test_an_unknown_keyword_is_named_with_the_closest_known(name):
    fn = getattr(unison, name)
    last = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY or p.default is not
            p.empty][-1]
    with pytest.raises(ConfigError, match=rf"^unison\.{name}: unknown .*'{last}x' \(did you mean '{last}'\?\)"):
        fn(**_required(fn, but=""), **{last + "x": 1})


@pytest.mark.parametrize("call, message", [
    (lambda: unison.train({"method": "byol"}), "unison.train: cfg={'method': 'byol'} (dict) must be a TrainConfig "
     "(unison.config); make one of the dict with TrainConfig.from_dict(d)"),
    (lambda: unison.train(None), "unison.train: cfg=None (NoneType) must be a TrainConfig (unison.config), e.g. "
     "unison.train(TrainConfig(method='simclr'))"),
    (lambda: unison.train(TrainConfig(), datset=[1]), "unison.train: unknown keyword argument 'datset' (did you mean "
     "'dataset'?); it takes cfg, backbone, feature_dim, dataset, transform, val, isolated"),
    (lambda: unison.train(TrainConfig(), None), "unison.train takes 1 positional argument(s) (cfg), given 2; give "
     "the others by name"),
    (lambda: unison.embed("runs/a", 123), "unison.embed: data=123 (int) must be a path (str or os.PathLike) or None"),
    (lambda: unison.export("runs/a", None), "unison.export: out=None (NoneType) must be a path (str or os.PathLike)"),
    (lambda: unison.check("simclr", world_size="2"), "unison.check: world_size='2' (str) must be an int"),
    (lambda: unison.check("simclr", world_size=True), "unison.check: world_size=True (bool) must be an int"),
    (lambda: unison.check("simclr", stepz=2), "unison.check: unknown option(s) 'stepz' (did you mean 'steps'?); "
     "known: "),
    (lambda: unison.check("simclr", steps="2"), "unison.check: steps='2' (str) must be an int"),
    (lambda: unison.evaluate("runs/a", knn_k="5"), "unison.evaluate: knn_k='5' (str) must be an int"),
    (lambda: unison.embed("runs/a", batch_size=None), "unison.embed: batch_size=None (NoneType) must be an int"),
    (lambda: unison.load_backbone("runs/a", device=0), "unison.load_backbone: device=0 (int) must be a str or a "
     "torch.device"),
], ids=["train-dict", "train-none", "train-typo", "train-positional", "embed-data-int", "export-out-none",
        "check-world-size-str", "check-world-size-bool", "check-option-typo", "check-option-type", "evaluate-option-type",
        "embed-option-none", "load-backbone-device"])
def test_the_trials_calls_are_one_line(call, message):
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_nested_configuration_given_as_a_dict_is_converted_or_refused_in_one_line():
    config = TrainConfig(distributed={"world_size": 1, "watchdog_s": 15})
    assert config.distributed == DistributedConfig(world_size=1, watchdog_s=15)
    with pytest.raises(ConfigError, match=r"unknown distributed option\(s\) 'wrld_size' \(did you mean 'world_size'"):
        TrainConfig(distributed={"wrld_size": 1})
    config.distributed = 4   # set afterwards: refused before anything reads it (no worker starts)
    with pytest.raises(ConfigError, match=r"^distributed=4 must be a DistributedConfig"):
        unison.train(config)


@pytest.mark.parametrize("option, value, message", [
    ("world_size", 0, "world_size=0 must be an integer >= 1"),
    ("steps", 0, "steps=0 must be an integer >= 1"),
    ("local_batch", 0, "local_batch=0 must be an integer >= 1"),
    ("image_size", 2, "image_size=2 must be an integer >= 8"),
    ("lr", 0.0, "lr=0.0 must be a finite number > 0"),
])
def test_a_check_option_out_of_range_is_named_as_given(option, value, message):
    """`unison.check("simclr", world_size=0)` named batch_size=0 (the training batch it builds from it)."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        unison.check("simclr", **{option: value})
