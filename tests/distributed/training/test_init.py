"""``--init`` / ``--freeze`` / ``--layer-decay`` in whole runs: one in-process run at world size 1 (small CNN, digits,
1 step) for what a run records and the export round trip, and runs of 2 workers under ``--shard full`` (FSDP2)
and ``--shard optimizer`` (ZeRO-1).
The step-level cases and the bad inputs are tests/unit/training/test_init.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fault_helpers import run_cli

from unison.cli import main
from unison.config import TrainConfig
from unison.models import build_backbone
from unison.training.init import prepare_backbone
from unison.training.init_read import read_init

# frozen blocks' batch norms run in eval mode: their running statistics stay the file's
FROZEN_STATISTICS = ("features.1.running_mean", "features.1.num_batches_tracked", "features.4.running_var")
TINY = ["--world-size", "1", "--max-steps", "1", "--no-progress", "--batch-size", "16", "--subset", "64",
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
    code = main(["train", *TINY, "--init", str(tmp / "cnn.pt"), "--freeze", "1", "--layer-decay", "0.5",
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
    argv = [*TINY, "--world-size", "2", "--max-steps", "2", "--shard", shard, "--init", str(trained["weights"]),
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
    assert main(["train", *TINY, "--max-steps", "2", "--resume", str(trained["run"]), "--init",
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
