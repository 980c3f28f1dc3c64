"""Hostile configuration, in this process: every case is one `unison: error:` line and exit code 2, fast.

Classes (issue "Nothing lost"): config files are read as bounded regular UTF-8 files and parsed strictly (no
aliases, string keys given once); every number is parsed by one bounded parser and every numeric field has a
stated range, checked in one place before any worker starts; values shown in errors are bounded. Each case runs
under an alarm, so a case that hangs or exhausts memory on old code fails here instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import typing
from pathlib import Path

import pytest

from unison.cli import main

W1 = ["--world-size", "1", "--max-steps", "1", "--no-progress", "--batch-size", "16", "--subset", "64",
      "--val-subset", "32", "--knn-k", "5"]
BOMB = ("epochs: [&a [1,2,3,4,5,6,7,8,9], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b],"
        " &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e,*e]]\n")


def _refuse(*args, **kwargs):
    raise AssertionError("the bad input was not refused: training or a worker process started")


@pytest.fixture(autouse=True)
def _no_process_starts(monkeypatch):
    """Every case here is refused before any worker: starting a process fails the case at once. This is what keeps
    these unit tests from starting processes (tests/conftest.py's rule), so `_run` may call ``main([COMMAND, ...])``."""
    import multiprocessing.process

    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)


@pytest.fixture
def no_training(monkeypatch):
    """The case is refused before training (the run's resolution, before any worker): reaching a worker fails it."""
    import unison.training.run

    monkeypatch.setattr(unison.training.run, "train_worker", _refuse)
    monkeypatch.setattr(unison.training.run, "launch", _refuse)


COMMAND = "train"


class _Hung(Exception):
    pass


@contextlib.contextmanager
def _within(seconds: int):
    """Fail (instead of hanging the suite) when the body takes longer than `seconds`."""
    def ring(signum, frame):
        raise _Hung(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(argv: list[str], capfd, seconds: int = 20) -> tuple[int, str]:
    """Exit code and stderr of `unison train ARGV` (argparse's SystemExit counts as an exit code)."""
    capfd.readouterr()
    with _within(seconds):
        try:
            code = main([COMMAND, *argv])
        except SystemExit as e:
            code = e.code
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return code, err


def _line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith(("unison: error:", "unison train: error:"))]
    assert len(lines) == 1, err[-3000:]
    assert len(lines[0]) < 400, lines[0]   # every value shown is bounded
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("hostile")
    texts = {
        "dup.yaml": "epochs: 3\nepochs: 0\n",
        "dup_block.yaml": "distributed:\n  world_size: 1\nseed: 2\ndistributed:\n  world_size: 2\n",
        "dup_nested.yaml": "distributed:\n  world_size: 1\n  world_size: 2\n",
        "int_key.yaml": "epochs: 1\n1: 2\n",
        "null_key.yaml": "null: 2\n",
        "bomb.yaml": BOMB,
        "deep.yaml": "epochs: " + "[" * 50000 + "]" * 50000 + "\n",
        "long_int.yaml": "epochs: " + "9" * 5000 + "\n",
        "batch_1e400.yaml": "batch_size: 1e400\n",
        "big_int.yaml": "batch_size: 123456789012345678901234567890\n",
        "long_string.yaml": "method: " + "x" * 200000 + "\n",
        "epochs_null.yaml": "epochs:\n",
        "params_null.yaml": "method_params: null\n",
    }
    for name, text in texts.items():
        (tmp / name).write_text(text)
    (tmp / "latin1.yaml").write_bytes("out: caf\xe9\n".encode("latin-1"))
    (tmp / "utf16.yaml").write_bytes("epochs: 1\n".encode("utf-16"))
    (tmp / "huge.yaml").write_bytes(b"# padding\n" * 200000)
    (tmp / "dir.yaml").mkdir()
    os.mkfifo(tmp / "fifo.yaml")
    return {"tmp": str(tmp)}


# (id, argv, message fragment); {t} is the fixture's folder. Exit code 2 for all.
YAML_CASES = [
    ("duplicate-key", ["--config", "{t}/dup.yaml"], "key 'epochs' is given twice, at lines 1 and 2; give it once"),
    ("duplicate-distributed-block", ["--config", "{t}/dup_block.yaml"],
     "key 'distributed' is given twice, at lines 1 and 4"),
    ("duplicate-nested-key", ["--config", "{t}/dup_nested.yaml"], "key 'world_size' is given twice, at lines 2 and 3"),
    ("latin-1", ["--config", "{t}/latin1.yaml"], "latin1.yaml is not UTF-8 text: byte 0xe9 at line 1; save it as UTF-8"),
    ("utf-16", ["--config", "{t}/utf16.yaml"], "is not UTF-8 text (it looks like UTF-16)"),
    ("int-key", ["--config", "{t}/int_key.yaml"], "line 2, column 1: key 1 is not a name: option names are strings"),
    ("null-key", ["--config", "{t}/null_key.yaml"], "key None is not a name: option names are strings"),
    ("alias-bomb", ["--config", "{t}/bomb.yaml"],
     "alias *'a' is not accepted in a config file or value: write the value out"),
    ("deep-nesting", ["--config", "{t}/deep.yaml"], "lists or mappings nested too deeply"),
    ("5000-digit-int", ["--config", "{t}/long_int.yaml"], "has more than 64 characters"),
    ("batch-1e400", ["--config", "{t}/batch_1e400.yaml"],
     "batch_size='1e400' is out of range: give an integer >= 1 and <= 2**24"),
    ("batch-30-digits", ["--config", "{t}/big_int.yaml"], "batch_size=123456789012345678901234567890 is out of range"),
    ("long-string", ["--config", "{t}/long_string.yaml"], "method='xxxxxxxx"),
    ("directory", ["--config", "{t}/dir.yaml"], "dir.yaml is a directory; give a YAML file"),
    ("dev-null", ["--config", "/dev/null"], "/dev/null is not a regular file (a device, pipe or socket)"),
    ("fifo", ["--config", "{t}/fifo.yaml"], "fifo.yaml is not a regular file"),
    ("over-1-MiB", ["--config", "{t}/huge.yaml"], "past the 1024 KiB a config file may have"),
    ("empty-path", ["--config", ""], "--config is empty; give a YAML file"),
    ("empty-value", ["--config", "{t}/epochs_null.yaml"], "line 1: epochs is empty; give a value or leave it out"),
    ("null-method-params", ["--config", "{t}/params_null.yaml"], "line 1: method_params is empty; give a value or leave it out"),
]

NUMBER_CASES = [
    *[(f"{flag}-1e5000", [f"--{flag}", "1e5000"], f"argument --{flag}: '1e5000' is out of range: give an integer")
      for flag in ("epochs", "seed", "master-port", "world-size", "powersgd-rank")],
    ("epochs-30-digits", ["--epochs", "9" * 30], "is out of range: give an integer >= 1 and <= 1000000000"),
    ("lr-100-chars", ["--lr", "0." + "1" * 100], "is out of range: give a finite number >= 0"),
    ("lr-1e400", ["--lr", "1e400"], "lr=inf must be a finite number >= 0"),
    ("param-1e5000", ["--param", "proj_dim=1e5000"], "--param proj_dim='1e5000' is out of range"),
    ("param-size-1e9", ["--param", "proj_dim=1e9"],
     "SimCLR parameter proj_dim=1000000000 must be an integer >= 1 and <= 2**20"),
    ("param-alias", ["--param", "proj_dim=[&a [1], *a]"], "alias *'a' is not accepted"),
    ("momentum-negative", ["--momentum", "-1"], "momentum=-1.0 must be a finite number in [0, 1)"),
    ("momentum-1", ["--momentum", "1"], "momentum=1.0 must be a finite number in [0, 1)"),
    ("grad-clip-0", ["--grad-clip", "0"], "grad_clip=0.0 must be a finite number > 0; omit --grad-clip for no clipping"),
    ("timeout-1e-9", ["--timeout-s", "1e-9"], "distributed.timeout_s=1e-09 must be a finite number >= 1"),
    ("watchdog-1ms", ["--watchdog-s", "0.001"], "watchdog_s=0.001 must be 0 (no watchdog) or at least 1 s"),
    ("image-size-1", ["--image-size", "1"], "image_size=1 must be an integer >= 8 and <= 8192"),
    ("batch-past-2-24", ["--batch-size", "1e9"], "batch_size=1000000000 must be an integer >= 1 and <= 2**24"),
    ("loader-workers-1e6", ["--loader-workers", "1e6"], "loader_workers=1000000 must be an integer >= 0 and <= 256"),
    ("threads-1e6", ["--threads", "1e6"], "threads=1000000 must be an integer >= 1 and <= 4096"),
    ("knn-k-1e9", ["--knn-k", "1e9"], "knn_k=1000000000 must be an integer >= 1 and <= 1000000"),
    ("knn-t-overflows", ["--knn-t", "1e-30"], "knn_t=1e-30 must be a finite number >= 0.02"),
    # a loss identically 0 (nothing trains, like --lr 0) or overflowing float32 at step 1 (NaN blamed on --lr)
    ("vicreg-all-weights-0", ["--method", "vicreg", "--param", "sim_weight=0", "--param", "var_weight=0",
                              "--param", "cov_weight=0"],
     "VICReg parameters sim_weight, var_weight, cov_weight turn every term of the loss off: the loss is 0"),
    ("ibot-all-weights-0", ["--method", "ibot", "--param", "cls_weight=0", "--param", "koleo_weight=0",
                            "--param", "mask_ratio=0"], "IBOT parameters cls_weight, patch_weight (with mask_ratio"),
    ("swav-1-prototype", ["--method", "swav", "--param", "n_prototypes=1"],
     "SwAV parameter n_prototypes=1 must be an integer >= 2 (a softmax over one entry is constant"),
    ("dino-out-dim-1", ["--method", "dino", "--param", "out_dim=1"], "DINO parameter out_dim=1 must be an integer >= 2"),
    ("ibot-out-dim-1", ["--method", "ibot", "--param", "out_dim=1"], "IBOT parameter out_dim=1 must be an integer >= 2"),
    ("simclr-temperature-1e-30", ["--param", "temperature=1e-30"],
     "SimCLR parameter temperature=1e-30 must be a finite number >= 0.0001 (logits 1/t past that overflow float32)"),
    ("moco-temperature-1e-9", ["--method", "moco", "--param", "temperature=1e-9"], "MoCo parameter temperature=1e-09"),
    ("mocov3-temperature-1e-9", ["--method", "mocov3", "--param", "temperature=1e-9"], "must be a finite number >= 0.0001"),
    ("dino-teacher-temp-1e-9", ["--method", "dino", "--param", "teacher_temp=1e-9"], "DINO parameter teacher_temp=1e-09"),
    ("dino-student-temp-1e-9", ["--method", "dino", "--param", "student_temp=1e-9"], "DINO parameter student_temp=1e-09"),
    ("swav-epsilon-0.01", ["--method", "swav", "--param", "sinkhorn_epsilon=0.01"],
     "SwAV parameter sinkhorn_epsilon=0.01 must be a finite number >= 0.02 (exp(1/epsilon) past that overflows"),
    ("ibot-sinkhorn-teacher-temp-0.01", ["--method", "ibot", "--param", "centering=sinkhorn", "--param",
                                         "teacher_temp=0.01"], "IBOT parameter teacher_temp=0.01 must be a finite number >= 0.02"),
    *[(f"{m}-batch-1", ["--method", m, "--batch-size", "1"], f"batch_size=1: {m} needs at least 2 images per step")
      for m in ("simclr", "byol", "mocov3")],   # a loss of 0 (SimCLR), a batch-norm traceback in the worker (others)
    ("barlowtwins-weight-1e38", ["--method", "barlowtwins", "--param", "lambda_offdiag=1e38"],
     "BarlowTwins parameter lambda_offdiag=1e+38 must be a number in [0, 1e+06] (a loss weight"),
    ("vicreg-weight-1e38", ["--method", "vicreg", "--param", "sim_weight=1e38"],
     "VICReg parameter sim_weight=1e+38 must be a number in [0, 1e+06]"),
    # what the workers would find, found by the pre-flight: the ViT's patch grid, attention heads, queue lengths
    ("vit-image-size", ["--method", "mae", "--image-size", "9"],
     "image_size=9 is not a multiple of the patch size 4 of vit_nano_p4; give --image-size a multiple of 4"),
    ("mae-heads", ["--method", "mae", "--param", "decoder_heads=7"],
     "MAE parameter decoder_dim=128 is not a multiple of decoder_heads=7"),
    ("moco-queue", ["--world-size", "2", "--method", "moco", "--param", "queue_size=20"],
     "MoCo queue_size=20 is not a multiple of the 32 keys enqueued per step"),
    ("swav-queue", ["--world-size", "2", "--method", "swav", "--param", "queue_length=12"],
     "SwAV queue_length=12 is not a multiple of the global batch 16"),
]

# Refused by the launcher in this process, after the pre-flight and before it starts any worker.
LAUNCH_CASES = [
    ("master-addr-not-here", ["--master-addr", "8.8.8.8"], "--master-addr '8.8.8.8' is not an address of this machine"),
    ("master-addr-unknown", ["--master-addr", "no-such-host.invalid"],
     "--master-addr 'no-such-host.invalid' is not an address of this machine"),
    ("master-addr-not-here-port-given", ["--master-addr", "8.8.8.8", "--master-port", "29999"],
     "--master-addr '8.8.8.8' is not an address of this machine"),
]


# A model that cannot fit in memory: refused by `run_training` (validated, then the model built on the meta
# device) before the pre-flight writes anything and before any worker; was a 4 TB allocation traceback in the worker.
MEMORY_CASES = [
    ("simclr-1M-wide-projector", ["--param", "proj_hidden_dim=1048576", "--param", "proj_dim=1048576"],
     "the model needs about 12.0 TiB (parameters, gradients and optimizer state; the largest tensor is "
     "projector.3.weight)", "lower --param proj_hidden_dim=1048576, proj_dim=1048576"),
    ("dino-1M-wide-head", ["--method", "dino", "--param", "out_dim=1048576", "--param", "bottleneck_dim=1048576"],
     "the model needs about 16.0 TiB", "lower --param out_dim=1048576, bottleneck_dim=1048576"),
]


@pytest.mark.parametrize("case_id, argv, size, lower", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_model_past_memory(case_id, argv, size, lower, capfd, tmp_path, monkeypatch):
    import unison.training.run

    monkeypatch.setattr(unison.training.run, "train_worker", _refuse)   # W=1 trains in this process
    code, err = _run([*W1, "--out", str(tmp_path / "run"), *argv], capfd)
    line = _line(err)
    assert code == 2 and size in line and lower in line, line
    assert not (tmp_path / "run").exists()


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.replace("{t}", files["tmp"]) for a in argv]


@pytest.mark.parametrize("case_id, argv, fragment", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_a_malformed_config_file_is_one_line(case_id, argv, fragment, files, capfd, tmp_path, no_training):
    code, err = _run([*W1, "--out", str(tmp_path / "run"), *_fill(argv, files)], capfd)
    line = _line(err)
    assert code == 2, err[-3000:]
    assert fragment in line, line
    assert not (tmp_path / "run").exists()   # refused before anything was written


@pytest.mark.parametrize("case_id, argv, fragment", NUMBER_CASES, ids=[c[0] for c in NUMBER_CASES])
def test_a_number_out_of_range_is_one_line(case_id, argv, fragment, capfd, tmp_path, no_training):
    code, err = _run([*W1, "--out", str(tmp_path / "run"), *argv], capfd)
    line = _line(err)
    assert code == 2, err[-3000:]
    assert fragment in line, line


@pytest.mark.parametrize("case_id, argv, fragment", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_a_bad_launch_address_is_one_line(case_id, argv, fragment, capfd, tmp_path):
    code, err = _run([*W1, "--world-size", "2", "--out", str(tmp_path / "run"), *argv], capfd, seconds=60)
    line = _line(err)
    assert code == 2, err[-3000:]
    assert fragment in line, line


ENV_CASES = [
    ("world-size-1e5000", {"RANK": "0", "WORLD_SIZE": "1e5000"}, "WORLD_SIZE='1e5000' is not an integer below 2**64"),
    ("master-port-5000-digits", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "9" * 5000},
     "MASTER_PORT='99999999"),
]


@pytest.mark.parametrize("case_id, env, fragment", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_a_bad_launch_environment_is_one_line(case_id, env, fragment, capfd, monkeypatch, tmp_path, no_training):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, err = _run([*W1, "--out", str(tmp_path / "run")], capfd)
    assert code == 2, err[-3000:]
    assert fragment in _line(err)


# ------------------------------------------------------------ every numeric field has a range, checked in one place
def _numeric_fields(cls: type) -> list[tuple[str, type, object]]:
    from unison.config.fields import base_type

    hints = typing.get_type_hints(cls)
    return [(f.name, base_type(hints[f.name]), f.metadata.get("range")) for f in dataclasses.fields(cls)
            if base_type(hints[f.name]) in (int, float)]


def test_every_numeric_field_states_a_range():
    from unison.config import DistributedConfig, TrainConfig

    missing = [f"{cls.__name__}.{name}" for cls in (TrainConfig, DistributedConfig)
               for name, _, rng in _numeric_fields(cls) if rng is None and name != "rank"]  # rank: [0, world_size)
    assert not missing, missing


def _outside(typ: type, rng) -> list[object]:
    values: list[object] = [] if typ is int else [math.nan, math.inf]
    if rng.lo is not None:
        values.append(rng.lo - (1 if typ is int else 1e-9 * max(1, abs(rng.lo))) if not rng.lo_open else rng.lo)
    if rng.hi is not None and rng.hi < 2**63:
        values.append(rng.hi + 1 if typ is int else (rng.hi * 1.5 if not rng.hi_open else rng.hi))
    return values


def _range_cases() -> list[tuple[str, str, object]]:
    from unison.config import DistributedConfig, TrainConfig

    return [(where, name, v) for where, cls in (("", TrainConfig), ("distributed", DistributedConfig))
            for name, typ, rng in _numeric_fields(cls) if rng is not None for v in _outside(typ, rng)]


@pytest.mark.parametrize("where, name, value", _range_cases())
def test_range_refused_from_a_plain_dict(where, name, value):
    """The check the pre-flight and every worker run (and a checkpoint's stored config can): `from_dict` + validate."""
    from unison.config import TrainConfig
    from unison.errors import ConfigError

    data: dict = {"distributed": {"world_size": 1}}
    (data["distributed"] if where else data)[name] = value
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data).validate(cuda_available=False)
    assert name in str(info.value)


def test_values_in_errors_are_bounded():
    """An alias-expanded value or a 5000-digit integer is shown cut, fast (reprlib-like), never in full."""
    from unison.config import TrainConfig
    from unison.config.fields import shown
    from unison.errors import ConfigError
    from unison.training.resolve import validate_run

    nested: list = [1] * 9
    for _ in range(8):
        nested = [nested] * 9    # 9**9 leaves if walked in full
    with _within(5):
        assert len(shown(nested)) <= 100 and len(shown(10**5000)) <= 100
        for bad in ({"epochs": nested}, {"method": "x" * 10**6}, {"out": 10**5000}, {10**5000: 1}, {None: 1}):
            with pytest.raises(ConfigError) as info:
                validate_run(TrainConfig.from_dict(bad), cuda_available=False)
            assert len(str(info.value)) < 1000


def test_grad_clip_none_still_means_no_clipping():
    from unison.config import TrainConfig

    assert TrainConfig(grad_clip=None).validate(cuda_available=False).grad_clip is None
    assert TrainConfig(grad_clip=1.0, momentum=0.0).validate(cuda_available=False).grad_clip == 1.0


def test_fifo_config_does_not_block(files, capfd, no_training):
    """Opening a FIFO for reading waits for a writer; the config reader must refuse it at once."""
    fifo = Path(files["tmp"]) / "fifo.yaml"
    code, err = _run(["--config", str(fifo)], capfd, seconds=5)
    assert code == 2 and "not a regular file" in _line(err)
