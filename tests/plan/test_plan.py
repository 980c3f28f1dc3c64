"""unison plan: the production step on a simulated W-rank job (fake process group, fake tensors), its host
synchronisations, the figures it reports against measured ones, and the command's bad inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.methods import METHODS
from unison.plan import cuda_check, simulate, step_host_syncs
from unison.plan.syncs import explain
from unison.training.resolve import validate_run

# the methods whose recipe trains a ViT plan on one (several need its patch tokens); the others on the small CNN
VIT_ONLY = {m for m in METHODS if METHODS[m].recipe.backbone.startswith("vit_")}
# The every-method tests' ViT: 2 blocks, not nano's 6: the same code paths (blocks wrapped one by one), a third of the
# fake-tensor dispatch, which made them the suite's longest file.
SMALL_VIT = "vit_micro_p4"


def _known(h) -> bool:
    return explain(h) is not None


def _cfg(method: str, shard: str = "full", amp: str = "bf16", world: int = 8, local: int = 2,
         vit: str = "vit_nano_p4") -> TrainConfig:
    """`method`'s run on `world` simulated GPUs; the methods that need patch tokens on ViT `vit`, I-JEPA at 32 px
    (room for its context block: 8 x 8 patches); `local` images per rank, or as many as the method's smallest batch
    needs (W-MSE's whitening)."""
    local = max(local, -(-METHODS[method].smallest_batch(METHODS[method].Params()) // world))
    cfg = TrainConfig(method=method, data="synthetic", backbone=vit if method in VIT_ONLY else "small_cnn",
                      batch_size=local * world, image_size=32 if method == "ijepa" else 16, amp=amp, progress=False,
                      teacher="random" if method == "distill" else None,
                      distributed=DistributedConfig(backend="nccl", world_size=world, shard=shard))
    return validate_run(cfg, cuda_available=True)


def _unexpected(figures) -> list[str]:
    return [str(h) for h in figures.host_syncs if not _known(h)]


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_on_8_simulated_ranks_with_bf16_and_fsdp(method):
    figures = simulate(_cfg(method, vit=SMALL_VIT), warmup=False)
    assert figures.flops > 0 and figures.peak > 0
    assert not _unexpected(figures)


# The --shard/--amp crossings besides the 8-rank test's (full, bf16). Where a host sync comes from the method, one
# crossing shows it; where it comes from a shard or amp path (ZeRO-1 reading Adam's step counter), that path is the
# same for every method, so the whole matrix runs for one method of each kind (contrastive, momentum, ViT).
CROSSINGS = (("none", "bf16"), ("optimizer", "none"), ("optimizer", "bf16"), ("full", "none"))
EVERY_CROSSING = {"simclr", "byol", "mae"}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_shard_and_amp_makes_only_explained_host_syncs(method):
    """The step of every method under --shard optimizer with --amp bf16, and of one method of each kind under
    every crossing (2 simulated ranks): each host sync it makes is one `unison.plan.syncs` explains."""
    found = {}
    for shard, amp in (CROSSINGS if method in EVERY_CROSSING else CROSSINGS[2:3]):
        syncs = step_host_syncs(_cfg(method, shard, amp, world=2, local=1, vit=SMALL_VIT))
        assert any(h.where.startswith("src/unison/training/step.py") for h in syncs)   # isfinite(loss): seen
        found.update({str(h): (shard, amp) for h in syncs if not _known(h)})
    assert not found, found


def test_an_unexplained_host_sync_is_found_and_printed(monkeypatch, capfd):
    from unison.methods.simclr import SimCLR

    forward = SimCLR.forward

    def planted(self, views, **kwargs):   # a data-dependent branch, as `if loss > 0:` would be
        loss = forward(self, views, **kwargs)
        return loss * 2 if bool(loss > 0) else loss

    monkeypatch.setattr(SimCLR, "forward", planted)
    syncs = step_host_syncs(_cfg("simclr", "none", "none", world=2, local=1))
    assert [h for h in syncs if not _known(h) and "test_plan.py" in h.where]
    code, out, err = _run(["--method", "simclr", "--backbone", "small_cnn", "--image-size", "16", "--batch-size",
                           "4", "--world-size", "2", "--backend", "nccl"], capfd)
    assert code == 0, err
    assert "NOT EXPLAINED" in out and "test_plan.py" in out and "1 x unison's finite-loss check: a NaN step" in out


@pytest.mark.parametrize("method, shard, amp", [("simclr", "none", "bf16"), ("moco", "optimizer", "bf16"),
                                               ("dino", "none", "bf16"), ("simclr", "none", "fp16")])
def test_gpu_code_path_on_fake_cuda_has_no_device_mismatch(method, shard, amp):
    """AutocastCUDA, torch.nn.SyncBatchNorm, DDP on a device, the optimizer and EMA/queue updates on fake CUDA
    tensors: no CPU tensor meets a CUDA one; torch's SyncBatchNorm synchronises (its empty-rank mask), and
    Adam's step counter is a CPU tensor (a host read, no device sync)."""
    check = cuda_check(_cfg(method, shard, amp))
    assert check.device_error is None and check.skipped is None
    torch_syncbn = [h for h in check.host_syncs if "torch/nn/modules/_functions.py" in h.inside]
    assert torch_syncbn and not _unexpected_cuda(check)


def test_a_cpu_tensor_in_the_gpu_step_is_found(monkeypatch):
    from unison.methods.simclr import SimCLR

    forward = SimCLR.forward

    def planted(self, views, **kwargs):   # a CPU tensor made inside the step, as `torch.zeros(1)` would
        return (forward(self, views, **kwargs).reshape(1) + torch.zeros(1)).sum()

    monkeypatch.setattr(SimCLR, "forward", planted)
    check = cuda_check(_cfg("simclr", "none", "bf16"))
    assert check.device_error and "test_plan.py" in check.device_error, check.device_error


def test_a_step_that_fails_is_one_line_naming_where(monkeypatch, capfd):
    """A configuration whose step raises (DINO's 96 px crops into timm's 224-px-only ViT) is the run's own
    failure at step 1: one line with the error and where, exit 2, before any GPU is booked."""
    from unison.methods.simclr import SimCLR

    def planted(self, views, **kwargs):
        raise AssertionError("Input height (96) doesn't match model (224).")

    monkeypatch.setattr(SimCLR, "forward", planted)
    code, _, err = _run(TINY, capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code == 2 and len(lines) == 1 and "doesn't match model (224)" in lines[0] and "test_plan.py" in lines[0]


def _unexpected_cuda(check) -> list[str]:
    return [str(h) for h in check.host_syncs if not _known(h)]


def test_sharding_divides_the_parameters_per_rank():
    """AdamW (two moments and a step counter per parameter), as benchmarks/fsdp_memory.py measures it."""
    none, zero1, full = (simulate(dataclasses.replace(_cfg("simclr", shard, "none", world=4), optimizer="adamw"))
                         for shard in ("none", "optimizer", "full"))
    # ZeRO-1: rank 0's share of the state (whole parameters', ~1/W; fake tensors' storages, all at address 0,
    # once counted as one: the step counter alone)
    assert zero1.params == none.params and 0.1 < zero1.optimizer / none.optimizer < 0.6
    # FSDP2: a quarter of each (its shards; whole parameters gathered at the peak are reported apart)
    for mine, whole in ((full.params, none.params), (full.grads, none.grads), (full.optimizer, none.optimizer)):
        assert abs(mine / whole - 0.25) < 0.02
    assert none.comm_bytes["all_reduce"] >= none.grads   # DDP's gradient all-reduce
    assert full.comm_bytes["reduce_scatter_tensor"] > 0


def test_figures_match_the_measured_cpu_step():
    """Parameters, gradients and optimizer state of the plan equal a real one-process CPU step's; FLOPs equal
    `unison.bench.flops` (the global batch's, here one rank's at W=1)."""
    from helpers.plan_measure import measure_cpu_step

    from unison.bench.flops import training_step_flops

    cfg = TrainConfig(method="simclr", data="synthetic", backbone="small_cnn", batch_size=4, image_size=16,
                      progress=False, channels_last=False, max_steps=2, distributed=DistributedConfig(backend="local", world_size=1))
    cfg = validate_run(cfg)
    plan = simulate(cfg)
    measured = measure_cpu_step(cfg, 16)
    params, grads, opt = measured["parameters"], measured["gradients"], measured["optimizer state"]
    assert abs(plan.params - params) <= 0.05 * params
    assert abs(plan.grads - grads) <= 0.05 * grads
    assert abs(plan.optimizer - opt) <= 0.05 * opt
    activations = measured["activations at peak"]
    assert abs(plan.activations - activations) <= 0.25 * activations, (plan.activations, activations)
    assert abs(plan.peak - measured["peak"]) <= 0.25 * measured["peak"]
    assert plan.flops == training_step_flops("simclr", "small_cnn", batch=4, image_size=16)


def _run(argv: list[str], capfd) -> tuple[int, str, str]:
    capfd.readouterr()
    try:
        code = main(["plan", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


TINY = ["--method", "simclr", "--backbone", "small_cnn", "--image-size", "16", "--batch-size", "4",
        "--world-size", "2", "--backend", "nccl", "--amp", "bf16", "--shard", "full"]


def test_json_reports_every_figure(capfd):
    """--time-budget: the steps the estimated step time fits, and the epochs of the data they make."""
    code, out, err = _run([*TINY, "--json", "--gpu", "a100-40", "--data", "digits", "--time-budget", "10m"], capfd)
    assert code == 0, err
    report = json.loads(out)
    for key in ("parameters_mib", "gradients_mib", "optimizer_state_mib", "activations_at_peak_mib", "peak_mib",
                "gpu_memory_mib", "max_local_batch", "matrix_flops_per_step", "collective_bytes_per_step",
                "estimate_step_s", "estimate_images_per_s", "host_syncs"):
        assert key in report
    steps = report["estimate_steps_in_budget"]
    assert report["time_budget_s"] == 600 and steps == int(600 // report["estimate_step_s"]) and steps > 0
    assert report["estimate_epochs_in_budget"] == pytest.approx(steps * 4 / 1438) and report["train_images"] == 1438
    assert all(h.startswith("item()/bool()/float()") for h in report["host_syncs"])
    assert report["fits"] and report["max_local_batch"] > 2 and report["world_size"] == 2
    assert report["gpu"].startswith("A100") and report["gpu_memory_mib"] == round(39.4 * 1024)


@pytest.mark.parametrize("argv, fragment", [
    (["--gpu", "h900"], "--gpu 'h900' is unknown"),
    (["--gpu", "0"], "the memory must be in"),
    (["--gpu", "nan"], "the memory must be in"),
    (["--gpu", "0.001"], "--gpu '0.001': 0.001 GiB is no GPU's memory; the memory must be in [1, 4096] GiB"),
    (["--mfu", "0"], "--mfu 0.0 must be in (0, 1]"),
    (["--world-size", "2", "--batch-size", "3"], "cannot be split evenly"),
    (["--grad-compression", "fp16", "--world-size", "2", "--backend", "nccl"], "--grad-compression"),
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capfd):
    code, _, err = _run(["--backbone", "small_cnn", *argv], capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err


# ---- the plan is the run's plan: its data, its image size, its micro-batches; it says what it is doing

def test_a_missing_data_folder_is_refused_in_one_line(capfd, tmp_path):
    code, out, err = _run(["--data", str(tmp_path / "nowhere")], capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code != 0 and not out and len(lines) == 1 and "nowhere does not exist" in lines[0], err


def test_the_plan_is_at_the_datas_image_size(capfd):
    """The digits train at 16 px (`unison train`'s resolution), not at a planner's own 224."""
    code, out, err = _run(["--data", "digits", "--backbone", "small_cnn", "--batch-size", "8", "--json"], capfd)
    assert code == 0, err
    report = json.loads(out)
    assert report["image_size"] == 16 and report["train_images"] == 1438


def test_the_plan_runs_every_micro_batch_of_a_step(capfd):
    """--grad-sync-every 4: four micro-batches per step (FLOPs x 4, one gradient all-reduce); a step beyond the
    data (K = 10**6: never finishes) is refused as training refuses it."""
    one, four = (json.loads(_run(["--data", "digits", "--backbone", "small_cnn", "--batch-size", "8", "--accumulation",
                                  "independent",
                                  "--grad-sync-every", k, "--json"], capfd)[1]) for k in ("1", "4"))
    assert four["grad_sync_every"] == 4 and four["images_per_step"] == 32
    assert abs(four["matrix_flops_per_step"] / one["matrix_flops_per_step"] - 4) < 0.01
    grown = four["collective_bytes_by_kind"]["all_reduce"] - one["collective_bytes_by_kind"]["all_reduce"]
    assert 0 < grown < one["gradients_mib"] * 2**20 / 4   # batch norm's per micro-batch; the gradients' once
    code, out, err = _run(["--data", "digits", "--backbone", "small_cnn", "--grad-sync-every", "1000000"], capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code != 0 and not out and len(lines) == 1 and "--grad-sync-every at most 5" in lines[0], err


def test_many_micro_batches_are_extrapolated_from_a_few(monkeypatch):
    """K = 100 simulates a few micro-batches (here 2 and 4) and extrapolates: FLOPs grow linearly in K."""
    import unison.plan
    from unison.plan import _simulate_step

    monkeypatch.setattr(unison.plan, "SIMULATED_MICRO_BATCHES", 4)

    def cfg(k: int) -> TrainConfig:
        c = _cfg("simclr", "none", "none", world=2, local=1)
        c.distributed.grad_sync_every, c.distributed.accumulation = k, "independent"
        return c

    many, note = _simulate_step(cfg(100), 200, lambda text: None, "a step")
    two = simulate(cfg(2), images=200)
    assert note == "simulated at 2 and 4, extrapolated linearly to 100"
    assert abs(many.flops / two.flops - 50) < 0.5


def test_a_batch_beyond_the_data_allocates_nothing(capfd):
    """--batch-size 2**24 is one line before anything the size of the batch exists (it took 7.3 GB)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, out, err = _run(["--data", "digits", "--batch-size", str(2**24)], capfd)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code != 0 and len(lines) == 1 and "fewer than one global batch (16777216)" in lines[0], err
    assert grown_mib < 500


def test_a_world_beyond_the_data_is_refused_at_once(capfd):
    """--world-size 65536 (a batch of 65536) was silent for over 200 s: now one line (the data holds fewer)."""
    code, out, err = _run(["--data", "digits", "--world-size", "65536", "--batch-size", "65536"], capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert code != 0 and len(lines) == 1 and "fewer than one global batch (65536)" in lines[0], err


def test_progress_lines_while_it_works_and_the_rows_are_aligned(capfd):
    code, out, err = _run(TINY, capfd)
    assert code == 0, err
    stages = [ln for ln in err.splitlines() if ln.startswith("unison plan: [")]
    assert any("simulating one step" in ln for ln in stages) and any("GPU code path" in ln for ln in stages), err
    rows = out.split("per rank:\n")[1].split("\n  fits")[0].splitlines()
    assert len(rows) == 8 and len({row.index("MiB") for row in rows}) == 1, rows


def test_without_data_it_plans_the_model_and_image_size_alone_in_the_words_a_user_knows(monkeypatch, capfd):
    """No --data: not the default digits (their 16 px and 1,438 images) but the model at 224 px, said so, the data
    never read; the host syncs named by what makes them (torch.nn.SyncBatchNorm), no file of torch's; the first
    progress line comes before torch is imported, and the budget is planned for."""
    import unison.plan

    monkeypatch.setattr(unison.plan, "planned_data", lambda cfg: pytest.fail("the data was read"))
    code, out, err = _run(["--backbone", "small_cnn", "--batch-size", "4", "--world-size", "2", "--backend", "nccl",
                           "--amp", "bf16", "--time-budget", "1h"], capfd)
    assert code == 0, err
    assert err.splitlines()[0] == "unison plan: [0 s] importing torch; reading the options", err
    head = out.splitlines()[0]
    assert " at 224 px, " in head and head.endswith("no --data: planned for the model and the image size alone (no "
                                                    "--image-size: 224 px); give --data to check it and count the "
                                                    "steps per epoch"), head
    assert "1,438" not in out and "torch/" not in out and ".py:" not in out, out
    assert "x torch.nn.SyncBatchNorm: drops empty ranks with a boolean mask" in out, out
    assert "  estimate for --time-budget 1h: " in out and " steps at that step time" in out, out


def test_a_run_that_does_not_fit_is_exit_1_with_its_report(monkeypatch, capfd):
    """A GPU of 64 KiB (below --gpu's range, so handed in here: a real one that small does not exist) holds not even
    the tiny CNN: the verdict is exit 1, after the whole report."""
    import unison.plan
    from unison.plan.gpus import GPU

    monkeypatch.setattr(unison.plan, "resolve_gpu", lambda spec: GPU("a 64 KiB GPU", 2**-14, 989.4, 450.0, "NVLink 4"))
    code, out, err = _run(TINY, capfd)
    assert code == 1 and "  does NOT fit in 0 MiB" in out, out + err
    assert out.splitlines()[-1] == ("unison plan: this run does NOT fit a 64 KiB GPU: not one image per rank fits: try "
                                    "--shard full, --amp bf16 or --activation-checkpointing (exit code 1)"), out


def test_progress_says_still_while_a_stage_runs():
    from unison.plan.progress import PlanProgress

    lines: list[str] = []
    with PlanProgress(lines.append, every_s=0.05) as progress:
        progress.stage("simulating")
        import time
        time.sleep(0.3)
    assert lines[0].endswith("] simulating") and any(ln.endswith("still simulating") for ln in lines[1:]), lines
