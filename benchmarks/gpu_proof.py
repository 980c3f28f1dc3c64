"""The GPU proof's phases, the pack writer and the size check; `benchmarks/gpu_proof.sh` and
`scripts/gpu_prepare.sh` call this file (docs/benchmarks.md, section "GPU").

    python3 benchmarks/gpu_proof.py pack SOURCE OUT.pack            # any data layout -> one pack file
    python3 benchmarks/gpu_proof.py size gpu_carry                   # what travels; exit 1 past the limits
    python3 benchmarks/gpu_proof.py phase NAME --out DIR [--device cuda|cpu] [--tiny] [--deadline EPOCH_S]
    python3 benchmarks/gpu_proof.py report --out DIR                 # DIR/phase-*.json -> proof.json + proof.md

Phases (each writes DIR/phase-NAME.json when it ends; `report` merges whatever exists):

* ``tests``: ``pytest -m gpu`` (tests/gpu), each test's outcome and first line of its message;
* ``throughput``: SimCLR ResNet-18 on the CIFAR-10 pack, unison against Lightly's pipeline (`benchmarks.lab.
  lightly_compare`, bf16); ResNet-50 and ViT-B/16 at 224 px on synthetic images, both sides: images/s, MFU
  against the card's measured bf16 matmul rate, and the share of the loop spent waiting for data;
* ``plan``: `unison plan`'s simulated peak against the measured `torch.cuda.max_memory_allocated`, 3 configs;
* ``step``: the speed-run step and its variants side by side (`benchmarks/step_variants.py`): cuDNN's timed
  algorithms against its default, the step without its augmentation, twice the batch;
* ``accuracy``: SimCLR ResNet-18 on the pack for what is left of the budget, kNN on the 5,000 val images.

``--tiny`` (with ``--device cpu``: the dry run the test suite runs) runs the same code on a generated 64-image
pack, small backbones at 32 px and a few steps.

Why this is a script and not a `unison bench` part: it is bound to one lent machine's limits (what travels, how
long one call may run) and writes partial results as it goes, which no other part needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))   # benchmarks.lab and tests.helpers, imported as from the repository root
CARRY = "gpu_carry"                       # the ignored folder that travels (scripts/gpu_prepare.sh builds it)
CARRY_LIMIT_MIB = 60                      # the prepared folder
TRAVEL_LIMIT_MIB = 64                     # the working tree plus the carried paths
COMMAND_LIMIT = 2000                      # characters of the device command line
# The two device calls (run one right after the other, on the warm machine) and their timeout_s
# (the headline first: each start of a machine costs about 30 s of the loan, and a cut-short loan keeps it)
DEVICE_CALLS = (("bash benchmarks/gpu_proof.sh --phases step,accuracy", 450),
                ('bash benchmarks/gpu_proof.sh --phases accuracy --accuracy-args "--batch-size 256"', 360))
DEVICE_CARRY = [CARRY]
PHASES = ("tests", "throughput", "plan", "step", "accuracy")
MIB = 2**20


# --------------------------------------------------------------------------- what travels
def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes() -> int:
    """Bytes of the working tree that travels without `carry`: tracked files and untracked, unignored ones."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         check=True).stdout
    return sum((REPO / f).stat().st_size for f in out.decode().split("\0") if f and (REPO / f).is_file())


def cmd_size(folder: str) -> int:
    carried, tree = folder_bytes(Path(folder)), tree_bytes()
    print(f"{folder}: {carried / MIB:.1f} MiB (limit {CARRY_LIMIT_MIB}); working tree {tree / MIB:.1f} MiB; "
          f"together {(carried + tree) / MIB:.1f} MiB (limit {TRAVEL_LIMIT_MIB})")
    if carried > CARRY_LIMIT_MIB * MIB or carried + tree > TRAVEL_LIMIT_MIB * MIB:
        print("error: over the limit: drop wheels, or pack fewer images", file=sys.stderr)
        return 1
    return 0


def cmd_pack(source: str, out: str) -> int:
    from unison.data.catalog import open_catalog
    from unison.data.pack import write_pack
    from unison.errors import DataError

    try:
        counts = write_pack(open_catalog(source), out)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {counts['images']:,} images, {counts['bytes'] / MIB:.1f} MiB")
    return 0


# --------------------------------------------------------------------------- settings
def settings(device: str, tiny: bool) -> dict[str, Any]:
    """Every size the phases use: the real run's, or the dry run's (same code, tiny work)."""
    if tiny:
        return {"tests_s": 100, "batch": 16, "lightly_steps": 3, "lightly_workers": 0, "synthetic": [("small_cnn", 32, 8)],
                "synthetic_steps": 2, "warmup_steps": 1, "plan": [("simclr", "small_cnn", 32, 8),
                                                                  ("byol", "small_cnn", 32, 8),
                                                                  ("simsiam", "small_cnn", 32, 8)],
                "knn_k": 5, "val_subset": None, "min_epochs": 1, "max_epochs": 1, "reserve_s": 0, "eval_every": 0,
                "profile_steps": 2}
    workers = min(16, os.cpu_count() or 1)
    return {"tests_s": 85, "batch": 512, "lightly_steps": 100, "lightly_workers": workers,
            "synthetic": [("resnet50", 224, 128), ("vit_base", 224, 128)], "synthetic_steps": 15, "warmup_steps": 3,
            "plan": [("simclr", "resnet18", 32, 512), ("simclr", "resnet50", 224, 128), ("mae", "vit_base", 224, 128)],
            "knn_k": 200, "val_subset": 5000, "min_epochs": 1, "max_epochs": 400, "reserve_s": 15,
            "eval_every": 20, "profile_steps": 20}


def data_paths(args: argparse.Namespace) -> tuple[str, str]:
    """The train and val packs: the prepared ones, or (``--tiny`` without them) a generated 64 + 32 image pair."""
    carry = REPO / CARRY
    if not args.tiny or (carry / "cifar10-train.pack").is_file() and args.device == "cuda":
        return str(carry / "cifar10-train.pack"), str(carry / "cifar10-val.pack")
    from unison.data.catalog import open_catalog
    from unison.data.generated import write_image_folder
    from unison.data.pack import write_pack

    root = Path(args.out) / "tiny-data"
    for split, n, seed in (("train", 64, 0), ("val", 32, 1)):
        if not (root / f"{split}.pack").is_file():
            write_image_folder(root / split, n, classes=2, sizes=(32, 32), seed=seed, modes=(("RGB", "JPEG", ".jpg"),))
            write_pack(open_catalog(str(root / split)), root / f"{split}.pack")
    return str(root / "train.pack"), str(root / "val.pack")


# --------------------------------------------------------------------------- phase 1: GPU tests
def phase_tests(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    xml = Path(args.out) / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rA", f"--junitxml={xml}",
           "tests/gpu"]
    try:   # under the phase's own time box, so that a hung test still leaves the outcomes of those before it
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=s["tests_s"])
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stdout, stderr = None, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {s['tests_s']} s"
    tests = [] if xml.is_file() else _verbose_outcomes(stdout)
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, message, details = "passed", "", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    if tag == "skipped" and "xfail" in (node.get("type") or ""):
                        outcome = "xfailed"
                    message = _first_line(node.get("message"), node.text)
                    # proof.json keeps the traceback's end: a device call is too dear to rerun for it
                    details = (node.text or "")[-2500:] if tag != "skipped" else ""
            tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                          "message": message, "details": details})
    return {"returncode": returncode, "tests": tests, "tail": stdout[-2000:] + stderr[-1000:]}


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _verbose_outcomes(stdout: str) -> list[dict[str, Any]]:
    """Outcomes from ``pytest -v`` lines (``path::test PASSED``), for a run killed before its junit file."""
    found = []
    for line in stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and "::" in words[0] and words[1] in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"):
            found.append({"test": words[0].split("::", 1)[1], "outcome": words[1].lower(), "seconds": 0.0,
                          "message": ""})
    found.append({"test": "(the rest)", "outcome": "not run: the time box ended", "seconds": 0.0, "message": ""})
    return found


def _first_line(message: str | None, text: str | None) -> str:
    """The informative line of a junit outcome: the message, unless pytest's generic one hides the reason."""
    for candidate in (message, text):
        line = (candidate or "").strip().splitlines()[0] if (candidate or "").strip() else ""
        if "Skipped: " in line:   # a module-level skip: ('file', line, 'Skipped: reason')
            line = line.split("Skipped: ", 1)[1].rstrip("')\"")
        if line and line != "collection skipped":
            return line[:300]
    return ""


# --------------------------------------------------------------------------- phase 2: throughput
def matmul_bf16(device: str) -> float:
    """The card's measured dense bf16 matmul FLOP/s (fp32 on the CPU, where bf16 matmul is not the fast path)."""
    import torch

    from unison.bench.flops import matmul_rate

    if device == "cuda":
        return matmul_rate(1, sizes=(4096, 8192), repeats=10, device="cuda", dtype=torch.bfloat16)
    return matmul_rate(torch.get_num_threads(), sizes=(256,), repeats=3)


def phase_throughput(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.lab.config import config_from_overrides
    from benchmarks.lab.lightly_compare import compare

    rate = matmul_bf16(args.device)
    train, val = data_paths(args)
    preset = "gpu1" if args.device == "cuda" else "cpu"
    over = {"preset": preset, "data": train, "val": val, "subset": None, "val_subset": None,
            "batch_size": s["batch"], "lightly_steps": s["lightly_steps"], "lightly_loader_workers": s["lightly_workers"],
            "knn_k": s["knn_k"], "train_args": "--amp bf16" if args.device == "cuda" else ""}
    if args.tiny:
        over.update(backbone="small_cnn", threads=1)
    cfg = config_from_overrides(over)
    result: dict[str, Any] = {"matmul_bf16_tflops": rate / 1e12,
                              "matmul_dtype": "bfloat16" if args.device == "cuda" else "float32",
                              "cifar_resnet18": [], "synthetic_224": []}
    args.save_partial(result)   # each part's figures are kept even if a later part runs past the time box
    rows = compare(cfg, train, val, Path(args.out) / "lightly")
    for r in rows:
        if not r.get("error"):
            r["mfu"] = (r.get("steady_tflops_per_s") or r["tflops_per_s"]) * 1e12 / rate
    result["cifar_resnet18"] = rows
    args.save_partial(result)
    for backbone, size, batch in s["synthetic"]:
        result["synthetic_224"].append(synthetic_pair(args, s, backbone, size, batch, rate))
        args.save_partial(result)
    return result


def synthetic_pair(args: argparse.Namespace, s: dict[str, Any], backbone: str, size: int, batch: int,
                   rate: float) -> dict[str, Any]:
    """unison's step and Lightly's pipeline on the same synthetic images, `s["synthetic_steps"]` timed steps each."""
    from unison.bench.flops import training_step_flops
    from unison.distributed.testing import run_in_workers

    flops = training_step_flops("simclr", backbone, batch, size)
    spec = {"device": args.device, "backbone": backbone, "size": size, "batch": batch,
            "steps": s["synthetic_steps"], "warmup": s["warmup_steps"], "workers": s["lightly_workers"]}
    out: dict[str, Any] = {"backbone": backbone, "image_size": size, "batch": batch, "step_gflop": flops / 1e9}
    for side, fn in (("unison", _unison_synthetic), ("lightly", _lightly_synthetic)):
        try:
            r = run_in_workers(fn, 1, args=(spec,), backend="local")[0]
        except Exception as e:   # one side failing must not lose the other's figures
            out[side] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
            continue
        r["images_per_s"] = spec["steps"] * batch / r["time_s"]
        r["mfu"] = flops * spec["steps"] / r["time_s"] / rate
        out[side] = r
    return out


def _synthetic_images(spec: dict[str, Any]):
    from unison.data.synthetic import synthetic_dataset

    return synthetic_dataset(spec["batch"] * (spec["steps"] + spec["warmup"]), spec["size"], 0)


def _unison_synthetic(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    one_process = DistributedConfig(backend="local", world_size=1)
    device = torch.device(spec["device"])
    cfg = TrainConfig(method="simclr", data="synthetic", backbone=spec["backbone"], batch_size=spec["batch"],
                      epochs=1, image_size=spec["size"], amp="bf16" if device.type == "cuda" else "none",
                      progress=False, online_probe=False, distributed=one_process)
    run = build_run(cfg, device, train_set=_synthetic_images(spec).to(device))
    wait = 0.0
    for batch in batches(run):
        if batch.step == spec["warmup"]:
            _sync(device)
            started, wait = time.perf_counter(), 0.0
        wait += batch.wait_s
        forward_backward(run, batch)
        optimizer_step(run, batch.step)
    _sync(device)
    took = time.perf_counter() - started
    return {"time_s": took, "data_wait_share": wait / took, "pipeline": "uint8 tensor on the device + batched "
            "ViewAugmenter (unison train's step)"}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lightly_synthetic(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead
    from lightly.transforms import SimCLRTransform
    from torch.utils.data import DataLoader

    from benchmarks.lab.lightly_compare import PILImages, user_loader_context
    from unison.models import build_backbone

    device = torch.device(spec["device"])
    data = _synthetic_images(spec)
    transform = SimCLRTransform(input_size=spec["size"], normalize={"mean": list(data.mean), "std": list(data.std)})
    loader = DataLoader(PILImages(data.images, data.labels, transform), batch_size=spec["batch"], drop_last=True,
                        shuffle=True, num_workers=spec["workers"], pin_memory=device.type == "cuda",
                        **user_loader_context(spec["workers"]))
    backbone, dim = build_backbone(spec["backbone"], image_size=spec["size"])
    model = torch.nn.Sequential(backbone, torch.nn.Flatten(1), SimCLRProjectionHead(dim, 512, 128)).to(device)
    model = model.to(memory_format=torch.channels_last)   # as unison's side (its default)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion, wait, step = NTXentLoss(temperature=0.5), 0.0, 0
    batches = iter(loader)
    while step < spec["warmup"] + spec["steps"]:
        if step == spec["warmup"]:
            _sync(device)
            started, wait = time.perf_counter(), 0.0
        asked = time.perf_counter()
        (x0, x1), _ = next(batches)
        wait += time.perf_counter() - asked
        x0, x1 = (x.to(device, non_blocking=True).to(memory_format=torch.channels_last) for x in (x0, x1))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = criterion(model(x0), model(x1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
    _sync(device)
    took = time.perf_counter() - started
    return {"time_s": took, "data_wait_share": wait / took, "loader_workers": spec["workers"],
            "pipeline": "PIL dataset + SimCLRTransform + DataLoader workers + SimCLRProjectionHead + NTXentLoss"}


# --------------------------------------------------------------------------- phase 3: plan against the device
def phase_plan(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from unison.distributed.testing import run_in_workers
    from unison.plan import simulate

    rows = []
    for method, backbone, size, batch in s["plan"]:
        cfg = _plan_config(method, backbone, size, batch, args.device)
        row: dict[str, Any] = {"method": method, "backbone": backbone, "image_size": size, "batch": batch,
                               "amp": cfg.amp}
        try:
            step = simulate(cfg)
            row["plan_peak_mib"] = (step.peak + step.ddp_buckets) / MIB
            if args.device == "cuda":
                measured = run_in_workers(_measured_peak, 1, args=(cfg, size), backend="local")[0]
            else:   # no allocator statistics on a CPU: the plan's own tracker on the real step
                from tests.helpers.plan_measure import measure_cpu_step

                measured = {"measured_peak_mib": measure_cpu_step(cfg, size)["peak"] / MIB,
                            "measured_by": "MemTracker on the real CPU step"}
            row.update(measured)
            row["plan_over_measured"] = row["plan_peak_mib"] / row["measured_peak_mib"]
        except Exception as e:   # one configuration failing must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows.append(row)
    return {"configs": rows}


def _plan_config(method: str, backbone: str, size: int, batch: int, device: str):
    """One GPU, one process: what the plan simulates and the measurement runs."""
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig

    return TrainConfig(method=method, data="synthetic", backbone=backbone, batch_size=batch, epochs=1,
                       image_size=size, amp="bf16" if device == "cuda" else "none", progress=False,
                       online_probe=False, distributed=DistributedConfig(backend="local", world_size=1))


def _measured_peak(cfg, size: int) -> dict[str, Any]:
    """Peak bytes of step 1 on CUDA (step 0 creates the optimizer's state, as in the plan):
    `torch.cuda.max_memory_allocated` less the synthetic images held on the device."""
    import torch

    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    data = synthetic_dataset(2 * cfg.batch_size, size).to("cuda")
    run = build_run(cfg, torch.device("cuda"), train_set=data)
    stream = batches(run)
    forward_backward(run, next(stream))
    optimizer_step(run, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(run, next(stream))
    optimizer_step(run, 1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - data.images.nbytes
    return {"measured_peak_mib": peak / MIB, "measured_by": "torch.cuda.max_memory_allocated",
            "reserved_mib": torch.cuda.max_memory_reserved() / MIB}


# --------------------------------------------------------------------------- phase 4: the step's variants
def phase_step(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from step_variants import measure  # benchmarks/, this script's folder (the first entry of sys.path)

    return measure(args.device, args.tiny, on_row=args.save_partial)


def _step_md(r: dict[str, Any]) -> list[str]:
    from step_variants import markdown

    return markdown(r)


# --------------------------------------------------------------------------- phase 5: time to accuracy
def phase_accuracy(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from unison.bench.table import run_train
    from unison.data.catalog import open_catalog
    from unison.distributed.launch import find_free_port

    train, val = data_paths(args)
    n = len(open_catalog(train))
    steps_per_epoch = n // s["batch"]
    left = (args.deadline - time.time() - s["reserve_s"]) if args.deadline else 60.0
    # `--time-budget`: the run measures its own step, plans warm-up and cosine for the steps that fit (start-up,
    # the final kNN and checkpoint included) and stops on time; the dry run caps it at one epoch
    budget_s = max(30, int(min(left, args.accuracy_s)))
    run_dir = Path(args.out) / "runs" / "accuracy"
    argv = ["train", "--preset", "speedrun", "--backbone", "resnet18" if not args.tiny else "small_cnn",
            "--data", train, "--val", val, "--time-budget", f"{budget_s}s", "--batch-size", str(s["batch"]),
            "--knn-k", str(s["knn_k"]), "--world-size", "1", "--out", str(run_dir), "--no-progress"]
    if s["max_epochs"] == 1:
        argv += ["--max-steps", str(max(1, steps_per_epoch))]
    if s["val_subset"]:
        argv += ["--val-subset", str(s["val_subset"])]
    if s["eval_every"]:   # the kNN-versus-time curve (metrics.csv comes back); each kNN is a second or two
        argv += ["--eval-every", str(s["eval_every"])]
    # where a step's time goes (the operator table comes back): a second or two of the budget, after step 10
    argv += ["--profile-steps", str(s["profile_steps"])]
    if args.device == "cuda":
        argv += ["--backend", "nccl", "--master-port", str(find_free_port())]   # speedrun: bf16, eager
    if args.tiny:   # the GPU's preset runs eager; the CPU's compiles, a start-up (6-7 s here) the dry run need not pay
        argv += ["--no-compile"]
    argv += shlex.split(args.accuracy_args)   # values to try against the preset's (the last of an option wins)
    summary, wall = run_train(argv, run_dir)   # a failure: cmd_phase records the worker's traceback
    used = summary.get("extra", {}).get("time_budget") or {}
    return {"command": "unison " + " ".join(argv), "epochs": round(summary["epochs"], 2), "steps": summary["steps"],
            "budget_left_s": left, "time_budget_s": budget_s, "budget_used_s": used.get("used_s"),
            "knn_top1": summary["knn_top1"],
            "knn_queries": s["val_subset"] or "all (tiny)", "train_time_s": summary["train_time_s"], "wall_s": wall,
            "data_wait_share": summary["data_wait_fraction"], "peak_memory_mib": summary["peak_memory_mib"]}


def _worker_traceback(exc: BaseException) -> str:
    """The last lines of the failed worker's traceback behind `exc` (run_train raises it `from None`)."""
    inner = exc.__cause__ or exc.__context__
    return "\n".join(str(getattr(inner, "traceback", "") or "").splitlines()[-40:])


# --------------------------------------------------------------------------- running and reporting
RUNNERS = {"tests": phase_tests, "throughput": phase_throughput, "plan": phase_plan, "step": phase_step,
           "accuracy": phase_accuracy}


def cmd_phase(args: argparse.Namespace) -> int:
    """Run one phase and write DIR/phase-NAME.json at its end, whether it worked or not."""
    import traceback

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    record: dict[str, Any] = {"phase": args.name, "device": args.device, "tiny": args.tiny, "machine": _machine()}

    def save_partial(result: dict[str, Any]) -> None:
        partial = {**record, "result": result, "status": "partial", "seconds": time.time() - started}
        (out / f"phase-{args.name}.json").write_text(json.dumps(partial, indent=1, default=str))

    args.save_partial = save_partial
    try:
        record["result"] = RUNNERS[args.name](args, settings(args.device, args.tiny))
        record["status"] = "ok"
    except Exception as e:
        traceback.print_exc()
        record["status"] = "failed"
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        record["worker_traceback"] = _worker_traceback(e)
    record["seconds"] = time.time() - started
    (out / f"phase-{args.name}.json").write_text(json.dumps(record, indent=1, default=str))
    return 0 if record["status"] == "ok" else 1


def cmd_report(out_dir: str) -> int:
    """Merge every phase record there is into proof.json and proof.md (a phase that never wrote one: its marker).
    Imports neither torch nor unison: it runs after every phase, on whatever records exist."""
    out = Path(out_dir)
    phases = {}
    for name in PHASES:
        f = out / f"phase-{name}.json"
        phases[name] = json.loads(f.read_text()) if f.is_file() else {"phase": name, "status": "not run"}
        marker = out / f"phase-{name}.status"
        if marker.is_file() and (not f.is_file() or phases[name]["status"] == "partial"):
            cut = marker.read_text().strip()
            phases[name]["status"] = cut + (": the parts below finished" if f.is_file() else "")
    machine = next((r["machine"] for r in phases.values() if "machine" in r), None)
    proof = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": machine, "phases": phases}
    (out / "proof.json").write_text(json.dumps(proof, indent=1, default=str))
    (out / "proof.md").write_text(proof_markdown(proof))
    return 0


def _machine() -> dict[str, Any]:
    from unison.bench.config import machine_info

    return machine_info()


def _f(x: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, spec)


def _describe(machine: dict[str, Any] | None) -> str:
    if not machine:
        return "unknown (no phase finished)"
    gpus = ", ".join(machine.get("gpus") or []) or "no GPU"
    return f"{gpus}; {machine['nproc']} cores, {machine['cpu']}; torch {machine['torch']}, Python {machine['python']}"


def proof_markdown(proof: dict[str, Any]) -> str:
    p = proof["phases"]
    lines = [f"# GPU proof, {proof['date_utc']} UTC", "", f"Machine: {_describe(proof['machine'])}", ""]
    for name in PHASES:
        rec = p[name]
        lines += [f"## {name}: {rec['status']}" + (f" ({rec['seconds']:.0f} s)" if "seconds" in rec else ""), ""]
        if rec.get("error"):
            lines += [f"Error: {rec['error']}", ""]
        result = rec.get("result")
        if result:
            lines += SECTIONS[name](result) + [""]
    return "\n".join(lines)


def _tests_md(r: dict[str, Any]) -> list[str]:
    rows = [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['message']} |" for t in r["tests"]]
    return ["| test | outcome | s | message |", "|---|---|---|---|", *rows] if rows else ["```", r["tail"], "```"]


def _throughput_md(r: dict[str, Any]) -> list[str]:
    lines = [f"Measured dense {r.get('matmul_dtype', 'bfloat16')} matmul: {r['matmul_bf16_tflops']:.3g} TFLOP/s "
             "(the MFU denominator; on a CPU only a check that the code runs).", "",
             "| workload | side | img/s (steady) | MFU | data wait | kNN |", "|---|---|---|---|---|---|"]
    for row in r["cifar_resnet18"]:
        if row.get("error"):
            lines.append(f"| SimCLR CIFAR-10 pack | {row['side']} | not measured: {row['error']} | | | |")
            continue
        lines.append(f"| SimCLR {row['backbone']} CIFAR-10 pack, batch {row['global_batch']} | {row['side']} | "
                     f"{_f(row.get('steady_images_per_s') or row['images_per_s'], '.0f')} | {_f(row.get('mfu'), '.1%')}"
                     f" | {_f(row.get('data_wait_share'), '.0%')} | {_f(row.get('knn_top1'), '.3f')} |")
    for pair in r["synthetic_224"]:
        for side in ("unison", "lightly"):
            x = pair[side]
            what = f"SimCLR {pair['backbone']} {pair['image_size']} px synthetic, batch {pair['batch']}"
            lines.append(f"| {what} | {side} | not measured: {x['error']} | | | |" if "error" in x else
                         f"| {what} | {side} | {x['images_per_s']:.0f} | {x['mfu']:.1%} | {x['data_wait_share']:.0%} | |")
    return lines


def _plan_md(r: dict[str, Any]) -> list[str]:
    lines = ["| config | plan peak MiB | measured peak MiB | plan / measured | measured by |", "|---|---|---|---|---|"]
    for c in r["configs"]:
        name = f"{c['method']} {c['backbone']} {c['image_size']} px batch {c['batch']} amp {c['amp']}"
        lines.append(f"| {name} | error: {c['error']} | | | |" if "error" in c else
                     f"| {name} | {c['plan_peak_mib']:.0f} | {c['measured_peak_mib']:.0f} | "
                     f"{c['plan_over_measured']:.2f} | {c['measured_by']} |")
    return lines


def _accuracy_md(r: dict[str, Any]) -> list[str]:
    return [f"kNN top-1 {_f(r['knn_top1'], '.4f')} after {r['epochs']} epochs ({r['steps']} steps planned by "
            f"--time-budget {r.get('time_budget_s')}s, {_f(r.get('budget_used_s'), '.0f')} s used): training "
            f"{r['train_time_s']:.0f} s, wall {r['wall_s']:.0f} s (process start, data, kNN included); data wait "
            f"{r['data_wait_share']:.0%}; queries: {r['knn_queries']}.", "", f"`{r['command']}`"]


SECTIONS = {"tests": _tests_md, "throughput": _throughput_md, "plan": _plan_md, "step": _step_md,
            "accuracy": _accuracy_md}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", allow_abbrev=False)
    pk.add_argument("source")
    pk.add_argument("out")
    sz = sub.add_parser("size", allow_abbrev=False)
    sz.add_argument("folder", nargs="?", default=str(REPO / CARRY))
    ph = sub.add_parser("phase", allow_abbrev=False)
    ph.add_argument("name", choices=PHASES)
    rp = sub.add_parser("report", allow_abbrev=False)
    for p in (ph, rp):
        p.add_argument("--out", required=True)
    ph.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ph.add_argument("--tiny", action="store_true")
    ph.add_argument("--deadline", type=float, default=None, help="epoch seconds by which the accuracy phase ends")
    ph.add_argument("--accuracy-s", type=float, default=300.0, help="the accuracy run's --time-budget (seconds)")
    ph.add_argument("--accuracy-args", default="", help="unison train options added to the accuracy run's (after "
                    "the preset's: they win), e.g. '--param temperature=0.2 --lr 0.3'")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        return cmd_pack(args.source, args.out)
    if args.cmd == "size":
        return cmd_size(args.folder)
    if args.cmd == "report":
        return cmd_report(args.out)
    return cmd_phase(args)


if __name__ == "__main__":   # the launcher's fork server imports this file: run only as a script
    sys.exit(main())
