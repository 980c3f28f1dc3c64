"""unison bench: counted communication bytes against the gradient size, writers, presets and CLI wiring."""

import csv
import dataclasses

import pytest

from benchmarks.lab import config as lab_config
from benchmarks.lab.lightly_compare import write_lightly
from unison.bench.comm import CommSpec, run_comm_report, write_comm
from unison.bench.config import PRESETS, BenchConfig, config_from_overrides, data_or_skip
from unison.bench.table import add_speedups, write_table
from unison.errors import ConfigError


@pytest.mark.slow
def test_comm_report_counts_gradient_bytes_exactly(tmp_path):
    specs = [CommSpec("simclr", "none"), CommSpec("simclr", "fp16"), CommSpec("moco", "none")]
    rows = run_comm_report(specs, backbone="small_cnn", global_batch=8, image_size=8, workers=2, steps=3)
    plain, fp16, moco = rows
    grad_bytes = plain["trainable_params"] * 4   # float32 parameters
    assert plain["ideal_grad_bytes"] == grad_bytes
    assert plain["grad_all_reduce_bytes"] == grad_bytes, "no compression: every gradient byte, once"
    assert fp16["grad_all_reduce_bytes"] == grad_bytes / 2, "fp16 compression: half"
    assert plain["all_gather_bytes"] > 0 and plain["broadcast_bytes"] == 0   # gathered negatives; SyncBN: no buffers
    # MoCo's shared queue is never broadcast after the one-off sync at step 1; its keys are gathered every step.
    assert moco["grad_all_reduce_bytes"] == moco["ideal_grad_bytes"]
    assert moco["broadcast_bytes"] == 0 and moco["all_gather_bytes"] > 0
    assert moco["first_step_broadcast_bytes"] > moco["queue_bytes"] > 0
    paths = write_comm(rows, tmp_path)
    assert _md_table_ok(paths["md"].read_text(), len(rows))
    assert len(list(csv.DictReader(open(paths["csv"])))) == len(rows)


def _fake_rows():
    rows = []
    for method, base in (("simclr", 100.0), ("moco", 120.0)):
        for config, w, sbn, t in (("1 worker", 1, None, base), ("2 workers, SyncBN + gather", 2, True, base / 1.6),
                                  ("2 workers, gather only", 2, False, base / 1.8)):
            rows.append({"method": method, "config": config, "backbone": "small_cnn", "global_batch": 256,
                         "epochs": 2.0, "steps": 38, "workers": w, "sync_batchnorm": sbn,
                         "gather": None if w == 1 else True, "threads_per_worker": 1, "knn_top1": 0.3,
                         "random_init_knn_top1": 0.2, "final_loss": 5.0, "train_time_s": t, "wall_s": t + 20,
                         "images_per_s": 38 * 256 / t, "speedup": None, "peak_memory_mib": 900.0 + w,
                         "peak_memory_per_rank": [900.0] * w, "peak_memory_kind": "peak_rss", "load_1m": 0.5,
                         "load_5m": 0.6, "load_15m": 0.7, "command": "unison train ..."})
    return add_speedups(rows)


def _md_table_ok(text: str, n_rows: int) -> bool:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    widths = {ln.count("|") - ln.count("\\|") for ln in lines}
    return len(lines) == n_rows + 2 and len(widths) == 1 and set(lines[1].replace("|", "")) == {"-"}


def test_table_writer_markdown_csv_png(tmp_path):
    rows = _fake_rows()
    assert rows[1]["speedup"] == pytest.approx(1.6) and rows[0]["speedup"] == 1.0
    paths = write_table(rows, tmp_path, header="## Distributed table\n\n", baseline_mib=700.0)
    md = paths["md"].read_text()
    assert _md_table_ok(md, len(rows)) and "1.60x" in md and "700 MiB" in md
    got = list(csv.DictReader(open(paths["csv"])))
    assert len(got) == len(rows) and float(got[2]["speedup"]) == pytest.approx(1.8)
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(paths["png"]).shape[0] > 100


def test_lightly_writer_reports_ratio_or_why_not(tmp_path):
    common = {"backbone": "small_cnn", "global_batch": 256, "steps": 40, "threads": 2, "train_time_s": 50.0,
              "wall_s": 70.0, "steady_from_step": 10, "knn_top1": 0.3, "peak_memory_mib": 900.0, "load_1m": 0.4,
              "version": "1", "error": None}
    rows = [{"side": "unison", "pipeline": "a", "loader_workers": 0, "images_per_s": 300.0,
             "steady_images_per_s": 320.0, **common},
            {"side": "lightly", "pipeline": "b", "loader_workers": 2, "images_per_s": 100.0,
             "steady_images_per_s": 160.0, **common}]
    md = write_lightly(rows, tmp_path)["md"].read_text()
    assert "2.00x at steady state** (after step 10), 3.00x over all steps" in md and _md_table_ok(md, 2)
    assert "warm-up is over" not in md   # no warm-up measured: nothing to warn about
    for r, tflops in zip(rows, (0.5, 0.1)):   # a GPU with a known peak: the fraction is printed
        r.update(step_gflop=3411.7, tflops_per_s=tflops, bf16_peak_tflops=989.4, peak_fraction=tflops / 989.4)
    md = write_lightly(rows, tmp_path)["md"].read_text()
    assert "| 0.500 | n/a | 0.1 % |" in md and "against 989.4 TFLOPS dense bf16" in md and _md_table_ok(md, 2)
    for r, share in zip(rows, (0.02, 0.3)):   # on a CPU: the measured matmul rate, and a long warm-up named
        r.update(bf16_peak_tflops=None, peak_fraction=None, steady_tflops_per_s=0.08, matmul_tflops_per_s=0.16,
                 matmul_fraction=0.5, warmup_s=share * 50.0, warmup_share=share)
    md = write_lightly(rows, tmp_path)["md"].read_text()
    assert "| 15.0 s (30 %) |" in md and "| 0.080 | 50 % |" in md and "against 160 GFLOP/s" in md
    assert "warm-up is over 5% of the time of lightly" in md and _md_table_ok(md, 2)
    rows[1] = {"side": "lightly", "pipeline": "not measured", "backbone": "small_cnn", "global_batch": 256,
               "steps": 40, "error": "ImportError: no module named lightly (pip install lightly)"}
    md = write_lightly(rows, tmp_path)["md"].read_text()
    assert "not measured: ImportError" in md and "ratio" not in md and _md_table_ok(md, 2)


def test_step_flops_counts_conv_and_matmul_work_and_scales_with_batch():
    from unison.bench.flops import training_step_flops

    # ResNet-18 with the CIFAR stem: about 0.56 GMACs per 32 px image forward, i.e. 1.11 GFLOP; a training step
    # is forward + backward (x3) of two views.
    per_step = training_step_flops("simclr", "resnet18", batch=512, image_size=32)
    assert per_step / (3 * 2 * 512) == pytest.approx(1.11e9, rel=0.03)
    # Linear in the batch but for NT-Xent's (2B x 2B) similarity matrix, a small quadratic term.
    small, double = training_step_flops("simclr", "small_cnn", 64, 32), training_step_flops("simclr", "small_cnn", 128, 32)
    assert 2 * small < double < 2.01 * small


def test_bf16_peak_lookup_prefers_the_specific_name():
    from unison.bench.flops import bf16_peak_tflops

    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA L40S") == 362.0 and bf16_peak_tflops("NVIDIA L4") == 121.0
    assert bf16_peak_tflops("NVIDIA GeForce GTX 1080") is None and bf16_peak_tflops(None) is None
    with pytest.raises(ConfigError, match="peak-tflops"):
        lab_config.config_from_overrides({"peak_tflops": 0})


def test_presets_and_overrides():
    gpu = config_from_overrides({"preset": "gpu", "epochs": 200})
    assert (gpu.backbone, gpu.batch_size, gpu.knn_k, gpu.epochs) == ("resnet18", 512, 200, 200)
    assert config_from_overrides({}) == PRESETS["cpu"] == BenchConfig()
    with pytest.raises(ConfigError, match="divisible"):
        config_from_overrides({"batch_size": 255})
    with pytest.raises(ConfigError, match="unknown"):
        config_from_overrides({"methods": "simclr,nope"})
    missing = dataclasses.replace(BenchConfig(), data="/nonexistent/cifar/train")
    assert "not found" in data_or_skip(missing)


def test_bench_command_reproduces_the_config_even_with_flag_like_values():
    import shlex

    from unison.bench.config import bench_command
    from unison.cli import make_parser

    cfg = config_from_overrides({"train_args": "--no-channels-last", "scaling_steps": 5})
    line = bench_command("scaling", cfg)
    assert "--train-args=--no-channels-last" in line
    ns = make_parser().parse_args(shlex.split(line)[1:])   # the printed line parses back to the same values
    assert ns.train_args == "--no-channels-last" and ns.scaling_steps == 5


def test_gpu1_preset_needs_one_gpu_for_the_lightly_comparison_only(monkeypatch):
    """`--preset gpu1`: Lightly's comparison on one GPU; parts that need several GPUs are refused on one."""
    import torch

    from unison.bench.commands import check_devices

    cfg = config_from_overrides({"preset": "gpu1"})
    assert cfg.backend == "nccl" and cfg.batch_size == 512 and cfg.backbone == "resnet18"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_devices(cfg, ["lightly"])
    with pytest.raises(ConfigError, match="1 GPU"):
        check_devices(cfg, ["table"])


def test_bench_data_runs_every_side_side_by_side(tmp_path, capsys):
    from unison.cli import main

    argv = ["bench", "data", "--out", str(tmp_path), "--data-images", "12", "--data-batch-size", "4",
            "--data-batches", "1", "--data-repeats", "1", "--data-loader-workers", "1"]
    assert main(argv) == 0
    table = (tmp_path / "data.md").read_text()
    for side in ("decode limit: libjpeg-turbo, full size", "decode limit: libjpeg-turbo, DCT-scaled for the crops",
                 "torchvision", "unison", "unison loader, colour ops on the device"):
        assert f"| {side} |" in table
    assert "| DALI, CPU pipeline" in table   # measured, or the reason it did not run
    assert "unison bench data" in table and "load average" in table and "Of the decode limit" in table
    rows = (tmp_path / "data.csv").read_text().splitlines()
    assert rows[0].startswith("side,images_per_s,per_process,per_cpu_s,of_decode_limit") and len(rows) == 7
    assert sum(1 for _ in (tmp_path / "data-jpegs-12").rglob("*.jpg")) == 12   # one of them a large photograph


def test_matmul_rate_counts_two_n_cubed_flops_per_product(monkeypatch):
    """The rate is 2 n^3 / the best time: with the clock mocked to 1 s per product, n=1024 gives 2.147 GFLOP/s."""
    import itertools

    from unison.bench import flops

    ticks = itertools.count()
    monkeypatch.setattr("time.perf_counter", lambda: float(next(ticks)))
    assert flops.matmul_rate(1, sizes=(1024,), repeats=2) == pytest.approx(2 * 1024**3)


BENCH = "bench"
TRAIN_ARGS_PARTS = ("table", "scaling", "lightly", "race", "all")   # every part whose runs take --train-args


@pytest.mark.parametrize("part", TRAIN_ARGS_PARTS)
@pytest.mark.parametrize("train_args, expected", [
    ('"', "bench: --train-args '\"' is not a command line (No closing quotation); give unison train's flags as one "
          "quoted string"),
    ("--lrr 1", "--train-args '--lrr 1': unrecognized arguments: --lrr 1 (did you mean --lr?)"),
    ("--lr abc", "--train-args '--lr abc': argument --lr: invalid float value: 'abc'"),
    ("--epochs 0", "--train-args '--epochs 0': epochs=0 must be an integer >= 1"),
])
def test_train_args_are_read_as_unison_train_reads_them_before_any_work(part, train_args, expected, tmp_path, capfd):
    """The dry run too: one line, exit 2, nothing printed or written before it."""
    from unison.cli import main

    out = tmp_path / "bench"
    code = main([BENCH, part, "--train-args", train_args, "--dry-run", "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 2 and not captured.out and not out.exists(), captured
    assert captured.err.count("\n") == 1 and captured.err.startswith("unison: error: ") and expected in captured.err


def test_train_args_that_unison_train_takes_pass_the_check(capfd):
    from unison.cli import main

    assert main([BENCH, "race", "--train-args", "--amp bf16 --param temperature=0.2", "--dry-run"]) == 0
    assert "--amp bf16 --param temperature=0.2" in capfd.readouterr().out


# -- with real processes --

def test_cli_dry_run_wires_the_gpu_preset(capsys):
    from unison.cli import main

    assert main(["bench", "all", "--preset", "gpu", "--dry-run", "--data", "cifar10", "--val", "cifar10"]) == 0
    out = capsys.readouterr().out
    train_lines = [ln for ln in out.splitlines() if ln.startswith("unison train")]
    assert len(train_lines) == 6 * 3 + 1 + 2          # table, Lightly comparison, scaling
    assert all("--backbone resnet18" in ln and "--batch-size 512" in ln and "--knn-k 200" in ln for ln in train_lines)
    assert sum("--world-size 4" in ln for ln in train_lines) == 6 * 2 + 1
    assert all("--backend nccl" in ln for ln in train_lines)
