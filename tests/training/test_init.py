"""``--init`` / ``--freeze`` / ``--layer-decay`` in the training step (`unison.training.init`, `unison.optim.groups`):
the step built directly on synthetic images, and the bad inputs in the pre-flight; then whole
runs.

``--init`` / ``--freeze`` / ``--layer-decay`` in whole runs: one in-process run at world size 1 (small CNN, digits,
1 step) for what a run records and the export round trip, and runs of 2 workers under ``--shard full`` (FSDP2)
and ``--shard optimizer`` (ZeRO-1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fault_helpers import run_cli

from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.errors import UnisonError
from unison.models import build_backbone
from unison.training.init import prepare_backbone
from unison.training.init_read import init_weights_of, read_init

TINY = ["--world-size", "1", "--max-steps", "1", "--batch-size", "16", "--subset", "64", "--val-subset", "16"]


def test_a_resumed_run_does_not_read_init(tmp_path):
    cfg = TrainConfig(backbone="small_cnn", init=str(tmp_path / "gone.pt"), resume=str(tmp_path / "run"))
    net, _ = build_backbone("small_cnn")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert init_weights_of(cfg) is None and prepare_backbone(net, cfg, "small_cnn") == {}
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_layer_decay_groups_and_frozen_parameters_over_two_steps(one_torch_thread):
    """ViT (6 blocks): block i gets lr * 0.5**(6 - i), the embeddings 0.5**7, the final norm and the heads lr;
    --freeze 1 keeps the embeddings and blocks.0 bit-identical over 2 steps."""
    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import accumulated_forward_backward, build_run, optimizer_step, steps

    cfg = TrainConfig(method="simclr", backbone="vit_nano_p2", data="synthetic", batch_size=4, max_steps=2, threads=1,
                      layer_decay=0.5, freeze="1", distributed=DistributedConfig(backend="local", world_size=1))
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
        named = dict(run.method.named_parameters())
        frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad and "momentum" not in n}
        assert {n.split(".")[1] for n in frozen} == {"patch_embed", "cls_token", "pos_embed", "blocks"}
        assert all(n.startswith("backbone.blocks.0.") for n in frozen if ".blocks." in n)
        group_of = {id(p): g for g in run.optimizer.param_groups for p in g["params"]}
        for micro in steps(run):
            accumulated_forward_backward(run, micro)
            lr = optimizer_step(run, micro[0].step)
            for n, p in named.items():
                if p.requires_grad:
                    block = int(n.split(".")[2]) + 1 if n.startswith("backbone.blocks.") else 7
                    assert group_of[id(p)]["lr"] == pytest.approx(lr * 0.5 ** (7 - block)), n
        assert all(torch.equal(named[n], v) for n, v in frozen.items())
    finally:
        shutdown_distributed(None)


class _Evil:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("case, code, fragment", [
    ("pickle", 4, "refused: it holds Python objects that could run code when unpickled (GLOBAL posix.mkdir)"),
    ("stem", 4, "the file has torchvision's ImageNet stem (7x7 conv1) and the backbone the CIFAR stem; use "
                "--backbone resnet18_imagenet"),
    ("missing", 4, "no such file"),
    ("freeze", 2, "--freeze 'blocks' names no part of the backbone"),
    ("decay", 2, "layer_decay=1.5 must be a finite number in (0, 1]"),
    ("own-out", 2, "is a checkpoint of --out"),
    ("empty-freeze", 2, "--freeze '' is not a list of block counts or module names"),
    ("superscript-freeze", 2, "--freeze '²' names no part of the backbone"),   # '²'.isdigit(): int('²') failed
    ("empty-init", 2, "--init '' is not a path; give a weights file or a run directory"),
    ("freeze-count", 2, "--freeze 9: the backbone has 3 blocks; give at most 3 (or 'all')"),
    ("freeze-typo", 2, "--freeze 'layer9' names no part of the backbone (did you mean 'layer4'?)"),
])
def test_bad_inputs_are_one_line_in_the_preflight(tmp_path, case, code, fragment):
    """What `unison train` runs before any worker starts (`resolve_run`, `preflight`): one line, its exit code."""
    from unison.cli.train_args import parse_train_args
    from unison.training.preflight import preflight
    from unison.training.resolve import resolve_run

    argv = [*TINY, "--out", str(tmp_path / "run")]
    if case == "pickle":
        torch.save({"features.0.weight": _Evil(tmp_path / "ran")}, tmp_path / "w.pt")
        argv += ["--init", str(tmp_path / "w.pt")]
    elif case == "stem":
        net, _ = build_backbone("resnet18_imagenet")
        torch.save({**net.state_dict(), "fc.weight": torch.zeros(10, 512)}, tmp_path / "w.pt")
        argv += ["--init", str(tmp_path / "w.pt"), "--backbone", "resnet18"]   # digits: 8 px, the CIFAR stem
    elif case == "missing":
        argv += ["--init", str(tmp_path / "w.pt")]
    elif case == "own-out":   # a fresh run into the run it starts from would prune those checkpoints
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / "step_1.pt").write_bytes(b"x")
        argv += ["--init", str(tmp_path / "run" / "checkpoints" / "step_1.pt")]
    elif case == "empty-freeze":   # was taken for no --freeze at all
        argv += ["--freeze", ""]
    elif case == "freeze":
        argv += ["--freeze", "blocks"]
    elif case == "superscript-freeze":
        argv += ["--freeze", "²"]
    elif case == "empty-init":
        argv += ["--init", ""]
    elif case == "freeze-count":
        argv += ["--freeze", "9"]
    elif case == "freeze-typo":
        argv += ["--freeze", "layer9", "--backbone", "resnet18"]
    else:
        argv += ["--layer-decay", "1.5"]
    with pytest.raises(UnisonError) as info:
        preflight(resolve_run(parse_train_args(argv)), launched=False)
    assert info.value.exit_code == code and fragment in str(info.value) and "\n" not in str(info.value), info.value
    assert not (tmp_path / "ran").exists() and not (tmp_path / "run" / "config.json").exists()


def _cast(kind: str):
    return {"int8": lambda v: v.to(torch.int8), "int32": lambda v: (v * 100).to(torch.int32), "bool": lambda v: v > 0,
            "complex": lambda v: v.to(torch.complex64), "float8": lambda v: v.to(torch.float8_e4m3fn),
            "sparse": lambda v: v.to_sparse(), "meta": lambda v: v.to("meta"),
            "quantised": lambda v: torch.quantize_per_tensor(v, 0.1, 0, torch.qint8)}[kind]


@pytest.mark.parametrize("kind, fragment", [
    ("int8", "tensor 'features.0.weight' is torch.int8 where the backbone's is torch.float32; integer, bool and "
             "complex values would be cast (bool weights start the run collapsed): give floating-point weights"),
    ("int32", "tensor 'features.0.weight' is torch.int32 where the backbone's is torch.float32"),
    ("bool", "tensor 'features.0.weight' is torch.bool where the backbone's is torch.float32"),
    ("complex", "tensor 'features.0.weight' is torch.complex64 where the backbone's is torch.float32"),
    ("float8", "tensor 'features.0.weight' is torch.float8_e4m3fn, an 8-bit float; give float16, bfloat16 or "
               "float32 weights"),
    ("sparse", "tensor 'features.0.weight' is a sparse tensor (torch.sparse_coo); give dense weights"),
    ("meta", "tensor 'features.0.weight' is on the meta device: it holds no values"),
    ("quantised", "tensor 'features.0.weight' is quantised (torch.qint8); give float weights"),
], ids=["int8", "int32", "bool", "complex", "float8", "sparse", "meta", "quantised"])
def test_init_weights_of_another_kind_are_one_line(tmp_path, kind, fragment):
    """--init weights that are not dense floats: refused by name, never cast silently nor a raw torch error."""
    from unison.cli.train_args import parse_train_args
    from unison.training.preflight import preflight
    from unison.training.resolve import resolve_run

    net, _ = build_backbone("small_cnn", 16)
    cast = _cast(kind)
    torch.save({k: cast(v) if v.is_floating_point() else v for k, v in net.state_dict().items()}, tmp_path / "w.pt")
    argv = [*TINY, "--out", str(tmp_path / "run"), "--init", str(tmp_path / "w.pt")]
    with pytest.raises(UnisonError) as info:
        preflight(resolve_run(parse_train_args(argv)), launched=False)
    message = str(info.value)
    assert info.value.exit_code == 4 and message.startswith(f"--init {tmp_path / 'w.pt'}: "), message
    assert fragment in message and "\n" not in message, message


def test_momentum_encoder_starts_from_init_too(tmp_path):
    """BYOL's target network is a copy of the backbone made by the method: built after the load, it holds the
    --init weights as well."""
    from unison.training.init import InitWeights
    from unison.training.model import build_method

    torch.manual_seed(9)
    src, _ = build_backbone("small_cnn")
    weights = InitWeights("w.pt", "state dict", src.state_dict())
    cfg = TrainConfig(method="byol", backbone="small_cnn")
    setup: dict = {}
    method = build_method(cfg, 10, torch.float32, torch.device("cpu"), 16, setup=setup, init=weights)
    for k, v in src.state_dict().items():
        assert torch.equal(method.backbone.state_dict()[k], v), k
    target = {k.split(".", 2)[-1]: v for k, v in method.state_dict().items() if k.startswith("target.backbone.")}
    assert target and all(torch.equal(target[k], src.state_dict()[k]) for k in target)
    assert setup["init"]["matched"] == 24


@pytest.mark.parametrize("option", ["layer_decay", "freeze"])
def test_check_run_refuses_what_it_would_leave_out(option):
    """``unison check --run`` trains whole runs without these options: refused, not silently ignored."""
    from unison.equivalence.curves import check_run_options
    from unison.errors import ConfigError

    with pytest.raises(ConfigError, match=f"does not take --{option.replace('_', '-')}"):
        check_run_options({option: 0.5 if option == "layer_decay" else "1"})


def test_a_restart_that_resumes_reads_no_init_in_the_preflight(tmp_path, monkeypatch):
    """A restarted or requeued attempt runs the same command: with a checkpoint in --out the workers resume from it, so the
    pre-flight does not read --init either (here it no longer exists)."""
    from unison.cli.train_args import parse_train_args
    from unison.training.preflight import check_crops, check_init_not_replaced, resumes_after_restart

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000001.pt").write_bytes(b"x")
    cfg = parse_train_args([*TINY, "--init", str(tmp_path / "gone.pt"), "--out", str(tmp_path / "run")])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resumes_after_restart(cfg)
    check_init_not_replaced(cfg, tmp_path / "run")
    check_crops(cfg, cfg.backbone, [])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    with pytest.raises(UnisonError, match="no such file"):
        check_crops(cfg, cfg.backbone, [])


# -- with real processes --

# frozen blocks' batch norms run in eval mode: their running statistics stay the file's
FROZEN_STATISTICS = ("features.1.running_mean", "features.1.num_batches_tracked", "features.4.running_var")
RUN_TINY = ["--world-size", "1", "--max-steps", "1", "--no-progress", "--batch-size", "16", "--subset", "64",
        "--val-subset", "16", "--knn-k", "5", "--no-random-init-knn", "--signal-images", "0", "--no-online-probe",
        "--logger", "none"]


def _run(argv: list[str], capfd) -> tuple[int, str]:
    return run_cli(["train", *argv], capfd)


def _error(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith(("unison: error:", "unison train: error:"))]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A small-CNN weights file, and a 1-step run started from it with --freeze 1 --layer-decay 0.5."""
    tmp = tmp_path_factory.mktemp("init")
    torch.manual_seed(3)
    net, _ = build_backbone("small_cnn")
    torch.save(net.state_dict(), tmp / "cnn.pt")
    os.chdir(tmp)
    code = main(["train", *RUN_TINY, "--init", str(tmp / "cnn.pt"), "--freeze", "1", "--layer-decay", "0.5",
                 "--out", str(tmp / "run")])
    assert code == 0
    return {"tmp": tmp, "weights": tmp / "cnn.pt", "run": tmp / "run"}


def test_run_starts_from_init_with_frozen_blocks_and_records_it(trained):
    from unison.training.checkpoint import load_checkpoint

    start = torch.load(trained["weights"])
    model = load_checkpoint(trained["run"])["model"]
    for k in ("features.0.weight", "features.1.weight", "features.3.weight", "features.4.bias", *FROZEN_STATISTICS):
        assert torch.equal(model[f"backbone.{k}"], start[k]), k   # --freeze 1: block ids 0, 1 (conv-BN blocks 0, 1)
    for k in ("features.6.weight", "features.9.weight", "features.7.running_mean"):
        assert not torch.equal(model[f"backbone.{k}"], start[k]), k   # trained
    resolved = json.loads((trained["run"] / "config.json").read_text())["resolved"]
    summary = json.loads((trained["run"] / "summary.json").read_text())
    assert resolved["init"]["matched"] == 24 and resolved["frozen_parameters"] == 6
    assert summary["extra"]["init"]["sha256"] == resolved["init"]["sha256"]


def test_export_and_run_dir_round_trip_into_init(trained):
    """The run's export and the run directory itself give the same weights (same sha256) as its checkpoint."""
    from unison.export import export_backbone
    from unison.training.checkpoint import load_checkpoint

    export_backbone(trained["run"], trained["tmp"] / "b.safetensors")
    reports = {}
    for what in ("b.safetensors", "run"):
        net, _ = build_backbone("small_cnn")
        weights = read_init(trained["tmp"] / what)
        reports[what] = {"source": weights.source, **prepare_backbone(net, TrainConfig(), "small_cnn", weights)["init"]}
        model = load_checkpoint(trained["run"])["model"]
        assert all(torch.equal(v, model[f"backbone.{k}"]) for k, v in net.state_dict().items())
    assert reports["b.safetensors"]["source"] == "unison export (small_cnn, simclr, step 1)"
    assert reports["run"]["source"] == "unison checkpoint (simclr, step 1)"
    assert reports["b.safetensors"]["sha256"] == reports["run"]["sha256"]


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_init_freeze_and_layer_decay_under_sharding(trained, capfd, shard):
    """2 workers, FSDP2 or ZeRO-1: the weights are loaded before wrapping (the frozen blocks equal the file's after
    2 steps), the report line is printed once."""
    from unison.training.checkpoint import load_checkpoint

    capfd.readouterr()
    argv = [*RUN_TINY, "--world-size", "2", "--max-steps", "2", "--shard", shard, "--init", str(trained["weights"]),
            "--freeze", "1", "--layer-decay", "0.5", "--out", str(trained["tmp"] / shard)]
    assert main(["train", *argv]) == 0
    err = capfd.readouterr().err
    assert err.count("unison: --init: matched 24 tensors of state dict") == 1 and "Traceback" not in err, err
    start = torch.load(trained["weights"])
    model = load_checkpoint(trained["tmp"] / shard)["model"]
    for k in ("features.0.weight", "features.1.weight", "features.3.weight", "features.4.bias", *FROZEN_STATISTICS):
        assert torch.equal(model[f"backbone.{k}"], start[k]), k
    for k in ("features.9.weight", "features.7.running_var"):
        assert not torch.equal(model[f"backbone.{k}"], start[k]), k


def test_a_resumed_run_takes_the_checkpoint_not_init(trained, capfd):
    """--resume with --init: the file is not read (here it does not exist), the record is the checkpoint's."""
    capfd.readouterr()
    out = trained["tmp"] / "branch"
    assert main(["train", *RUN_TINY, "--max-steps", "2", "--resume", str(trained["run"]), "--init",
                 str(trained["tmp"] / "gone.pt"), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert f"--init {trained['tmp'] / 'gone.pt'} not read: the run resumes from" in err and "Traceback" not in err
    first = json.loads((trained["run"] / "config.json").read_text())["resolved"]["init"]
    assert json.loads((out / "config.json").read_text())["resolved"]["init"] == first


def test_the_random_init_baseline_of_an_init_run_is_random_and_the_start_is_scored_by_its_own_name(trained, capfd):
    """A run started from --init weights scores two baselines before training: a random encoder at the run's seed
    (the one it would have started from without --init: the same kNN as the run without --init) and the --init
    weights themselves. Before, the "random init" baseline was measured after the weights were loaded, so it was
    their kNN. The weights here are another seed's random encoder, whose kNN differs from this seed's."""
    from unison.models.backbones import build_backbone as build
    from unison.training.model import seed_everything

    seed_everything(1, False)   # the encoder a --seed 1 run starts from: --init of a --seed 0 run
    net, _ = build("small_cnn")
    torch.save(net.state_dict(), trained["tmp"] / "seed1.pt")
    scored = ["--world-size", "1", "--max-steps", "1", "--no-progress", "--batch-size", "16", "--subset", "256",
              "--val-subset", "64", "--knn-k", "5", "--signal-images", "0", "--no-online-probe", "--seed", "0"]
    summaries = {}
    for name, extra in (("plain", []), ("init", ["--init", str(trained["tmp"] / "seed1.pt")])):
        code, err = _run([*scored, *extra, "--out", str(trained["tmp"] / f"baseline-{name}")], capfd)
        assert code == 0, err
        summaries[name] = json.loads((trained["tmp"] / f"baseline-{name}" / "summary.json").read_text())
    plain, init = summaries["plain"], summaries["init"]
    assert init["random_init_knn_top1"] == plain["random_init_knn_top1"]   # a random encoder, this seed's
    assert init["init_knn_top1"] != plain["random_init_knn_top1"]          # the --init weights, scored apart
    assert plain["init_knn_top1"] is None   # no --init: one baseline
    run = trained["tmp"] / "baseline-init"
    line = (run / "train.log").read_text().strip().splitlines()[-1]
    assert (f"vs random init {init['random_init_knn_top1']:.4f}, vs --init weights {init['init_knn_top1']:.4f}"
            in line), line
    assert f"--init weights kNN top-1 {init['init_knn_top1']:.4f}" in (run / "train.log").read_text()
