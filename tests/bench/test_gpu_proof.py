"""The GPU proof stays runnable and within the lent machine's limits: its CPU dry run runs every phase's code, the
device command line fits, and what travels fits (benchmarks/gpu_proof.sh, scripts/gpu_prepare.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CIFAR = REPO.parent / "shared/data/cifar10"
WHEELS_MIB = 2.0   # the carried wheels measured 0.7 MiB (simplejpeg, braceexpand, lightly, lightning-utilities)


def _proof_module():
    spec = importlib.util.spec_from_file_location("gpu_proof", REPO / "benchmarks/gpu_proof.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_phase_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "UNISON_PROOF_WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "UNISON_NO_CACHE": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu_proof.sh", "--device", "cpu", "--tiny", "--accuracy-args",
                           "--param temperature=0.3 --lr 0.2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "accuracy-metrics.csv", "accuracy-profile-ops.txt", "accuracy-train.log", "gpu_proof.log", "proof.json",
        "proof.md"]
    assert "profile: 2 steps" in (tmp_path / "out/accuracy-train.log").read_text()
    proof = json.loads((tmp_path / "out/proof.json").read_text())
    phases = proof["phases"]
    assert {name: p["status"] for name, p in phases.items()} == dict.fromkeys(
        ("tests", "throughput", "plan", "step", "accuracy"), "ok"), proc.stdout[-3000:]
    assert [t["outcome"] for t in phases["tests"]["result"]["tests"]] == ["skipped"]   # no CUDA here: one line
    assert "no CUDA device" in phases["tests"]["result"]["tests"][0]["message"]
    throughput = phases["throughput"]["result"]
    assert [r["side"] for r in throughput["cifar_resnet18"]] == ["unison", "lightly"]
    assert all(r["error"] is None and r["images_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1
               for r in throughput["cifar_resnet18"])
    assert all(pair[side]["images_per_s"] > 0 for pair in throughput["synthetic_224"] for side in ("unison", "lightly"))
    assert all(c["plan_peak_mib"] > 0 and c["measured_peak_mib"] > 0 for c in phases["plan"]["result"]["configs"])
    variants = phases["step"]["result"]["variants"]
    assert [v["variant"] for v in variants] == ["preset", "cudnn default", "fixed views", "batch 2x", "batch 0.5x"]
    assert all(v["ms_per_step"] > 0 for v in variants) and [v["batch"] for v in variants] == [16, 16, 16, 32, 8]
    assert 0 <= phases["accuracy"]["result"]["knn_top1"] <= 1
    trained = json.loads((tmp_path / "work/runs/accuracy/config.json").read_text())   # --accuracy-args won
    assert (trained["method_params"]["temperature"], trained["lr"]) == (0.3, 0.2), trained
    assert not trained["compile"], trained   # eager, as the GPU's preset
    assert "## accuracy: ok" in (tmp_path / "out/proof.md").read_text()


def test_the_device_command_and_carry_list_are_the_documented_ones_and_fit():
    proof = _proof_module()
    docs = (REPO / "docs/benchmarks.md").read_text()
    for command, timeout_s in proof.DEVICE_CALLS:
        assert len(command) < proof.COMMAND_LIMIT and timeout_s <= 600
        assert f"command = `{command}`, timeout_s = {timeout_s}" in docs
    assert f"carry = `{json.dumps(proof.DEVICE_CARRY)}`" in docs
    assert proof.DEVICE_CARRY == [proof.CARRY] and f"/{proof.CARRY}/" in (REPO / ".gitignore").read_text()


def test_what_travels_stays_under_the_limits():
    proof = _proof_module()
    carried = REPO / proof.CARRY
    if carried.is_dir():
        size = proof.folder_bytes(carried)
    elif CIFAR.is_dir():
        from unison.data.catalog import open_catalog
        from unison.data.pack import pack_size

        size = sum(pack_size(open_catalog(str(CIFAR / split))) for split in ("train", "val")) + WHEELS_MIB * 2**20
    else:
        pytest.skip(f"neither {carried} (scripts/gpu_prepare.sh) nor the CIFAR-10 data ({CIFAR}) is here")
    assert size <= proof.CARRY_LIMIT_MIB * 2**20
    assert size + proof.tree_bytes() <= proof.TRAVEL_LIMIT_MIB * 2**20


def test_a_phase_cut_short_reports_the_parts_it_finished(tmp_path):
    """On an H100 the throughput phase ran past its time box and returned nothing; now each part is kept."""
    proof = _proof_module()
    partial = {"phase": "throughput", "status": "partial", "seconds": 200.0, "machine": None,
               "result": {"matmul_bf16_tflops": 612.0, "matmul_dtype": "bfloat16", "cifar_resnet18": [],
                          "synthetic_224": []}}
    (tmp_path / "phase-throughput.json").write_text(json.dumps(partial))
    (tmp_path / "phase-throughput.status").write_text("timed out after 240 s\n")
    assert proof.cmd_report(str(tmp_path)) == 0
    text = (tmp_path / "proof.md").read_text()
    assert "## throughput: timed out after 240 s: the parts below finished" in text and "612 TFLOP/s" in text
    assert "## tests: not run" in text
