"""The README's commands run as written, at small size, and so does the YAML example they use.

Every command of the README's "Using it" block is taken from README.md itself and run in a fresh directory (with a
copy of ``examples/``), with flags appended that make it small: a few steps on a tiny ImageFolder standing in for
``/data/cifar10/{train,val}``, 2 workers instead of 4, 16 px images, tiny subsets (the signals' held-back images
too) and k. What is not a matter of size is kept as written; two commands are narrowed:

* ``check --method all`` runs SimCLR and MAE, a CNN recipe and a ViT one, at their recipes' backbones; under
  ``--shard full`` SimCLR alone (every method's check, the ViT methods on a smaller ViT:
  tests/parallel/test_fsdp.py and tests/equivalence/test_accumulation.py);
* ``bench all`` is a ``--dry-run`` (the benchmarks measure for minutes).

The speedrun command runs without the ``--compile`` its preset turns on where a C++ compiler is found: compiling
its step costs minutes of CPU on a loaded 2-core machine, the suite's largest single cost; compiling is tested in
tests/training/test_compile.py, and a budgeted run that does not time its compiling steps in
tests/training/test_budget.py. ``check --no-sync-batchnorm`` is expected to fail: the README says so.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# 16 px images: the README's ResNet-18 at 32 px made its train commands the test's largest cost (each 2-worker step of 16
# images about a second of a 2-core CPU); the size changes no code path the commands take.
SMALL_TRAIN = ["--max-steps", "2", "--batch-size", "8", "--subset", "16", "--val-subset", "8", "--signal-images", "8",
               "--knn-k", "5", "--image-size", "16", "--no-progress"]


def readme_commands() -> list[str]:
    """The commands of the README's "Using it" code block, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no 'Using it' bash block"
    joined = block.group(1).replace("\\\n", " ")
    commands = (" ".join(shlex.split(line, comments=True)) for line in joined.splitlines())
    return [c for c in commands if c]   # blank and comment-only lines are no commands


def _png_folder(root: Path, per_class: int) -> None:
    from PIL import Image

    for c in range(2):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (32, 32), (8 * i, 120 * c, 255 - 8 * i)).save(root / f"class{c}" / f"{i:02d}.png")


def small(argv: list[str]) -> tuple[list[str], int]:
    """`argv` as run by the test (size flags appended; see the module docstring) and the exit code it must end with."""
    command, sub = argv[0], argv[1] if len(argv) > 1 else ""
    if command == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                *["2" if a == "4" and argv[i - 1] == "--nproc-per-node" else a for i, a in enumerate(argv[1:], 1)]]
        return [*argv, *SMALL_TRAIN, "--out", "runs/torchrun"], 0
    assert command == "unison", argv
    argv = [sys.executable, "-m", "unison.cli", *argv[1:]]
    if sub == "train":
        speedrun = ["--no-compile"] if "speedrun" in argv else []
        return [*argv, *SMALL_TRAIN, *speedrun, "--world-size", "2", "--data", "data/train", "--val", "data/val"], 0
    if sub == "check" and "--run" in argv:
        return [*argv, "--run-steps", "4", "--run-batch-size", "16"], 0
    if sub == "check":
        narrowed = "simclr" if "--shard" in argv else "simclr,mae"   # under FSDP: every method in test_fsdp.py
        argv = [a if a != "all" else narrowed for a in argv]
        return [*argv, "--steps", "2", "--local-batch", "4"], (1 if "--no-sync-batchnorm" in argv else 0)
    if sub == "eval":
        fine_tune = ["--epochs", "1", "--train-batch-size", "4"] if "--fine-tune" in argv else []   # tiny data
        return [*argv, "--linear-epochs", "2", "--knn-k", "5", *fine_tune], 0
    if sub == "bench":
        return [*argv, "--dry-run"], 0
    return argv, 0


def run_command(line: str, cwd: Path, env: dict[str, str]) -> str:
    """Run one README command at small size; '' if it ended as the README says, else what went wrong."""
    argv = [a.replace("/data/cifar10/", "data/") for a in shlex.split(line)]
    argv, expected = small(argv)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != expected:
        return f"{line}: exit {proc.returncode}, expected {expected}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if "Traceback" in proc.stderr and not line.startswith("torchrun"):
        return f"{line}: a traceback\n{proc.stderr[-3000:]}"
    return ""


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert any("--config examples/configs/simclr_cifar10.yaml" in c for c in commands)   # the YAML example is among them
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    _png_folder(tmp_path / "data" / "train", 24)
    _png_folder(tmp_path / "data" / "val", 8)
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "UNISON_NO_CACHE": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # Two lanes run side by side (the suite's time): the commands on the default run directory in their order
    # (train, --resume, eval, export), and the ones that stand alone.
    uses_default_run = [c for c in commands if "runs/default" in c or (c.startswith("unison train") and "--out" not in c
                                                                         and "--config" not in c)]
    lanes = [uses_default_run, [c for c in commands if c not in uses_default_run]]
    with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
        failures = [f for lane in pool.map(lambda lane: [run_command(c, tmp_path, env) for c in lane], lanes)
                    for f in lane if f]
    assert not failures, "\n\n".join(failures)
    assert (tmp_path / "runs" / "simclr_cifar10" / "config.json").exists()   # the YAML example's --out
    assert (tmp_path / "backbone.pt").exists() and (tmp_path / "backbone.json").exists()
