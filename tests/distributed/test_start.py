"""How workers start (`unison.distributed.start`): the ``unison`` command forks them from its own process where
that is safe (no GPU device, no thread started since the command began); everything else, and a command whose
process has since started OpenMP's pool, gets them from the fork server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from unison.config.distributed import gpu_device_node_found

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
NO_GPU = not gpu_device_node_found()   # a GPU machine: the fork server, always

_RULE = """
import os, torch
from unison.config.distributed import DistributedConfig
from unison.distributed.launch import launch
from unison.distributed.start import fork_from_here

def parent_after_a_parallel_op(_):
    torch.ones(4_000_000).exp().sum()   # 2 threads (threads_per_worker): hangs in a worker forked from OpenMP's pool
    return os.getppid()

if __name__ == "__main__":
    run = lambda: launch(parent_after_a_parallel_op, None, DistributedConfig(world_size=2), threads_per_worker=2)
    here = [os.getpid()] * 2
    fork_from_here()
    print(run() == here)                  # forked from here
    torch.set_num_threads(2)
    torch.ones(4_000_000).exp().sum()     # OpenMP's pool runs in this process from now on
    print(run() == here)                  # the fork server: a worker forked from here would hang
"""


def test_workers_fork_from_the_command_only_before_openmp_started_its_threads(tmp_path):
    script = tmp_path / "rule.py"
    script.write_text(_RULE)
    proc = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(NO_GPU), "False"], proc.stdout + proc.stderr[-3000:]


_PARENT_HOOK = """
import os
from unison.training.hooks import TrainHook

class Parent(TrainHook):
    def __init__(self, rank):
        self.rank = rank

    def start(self, run, step):
        with open(os.path.join(os.environ["PARENT_DIR"], f"rank{self.rank}"), "w") as f:
            f.write(str(os.getppid()))

def train_hooks(cfg, rank):
    return [Parent(rank)]
"""


def test_the_unison_command_forks_its_workers_from_its_own_process(tmp_path):
    (tmp_path / "parent_hook.py").write_text(_PARENT_HOOK)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]]),
           "UNISON_TRAIN_HOOKS": "parent_hook", "PARENT_DIR": str(tmp_path), "UNISON_NO_CACHE": "1"}
    argv = [sys.executable, "-m", "unison.cli", "train", "--world-size", "2", "--data", "digits", "--image-size", "16",
            "--backbone", "small_cnn", "--batch-size", "16", "--max-steps", "1", "--no-knn", "--no-progress",
            "--signal-images", "0", "--no-online-probe", "--out", str(tmp_path / "run")]
    command = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = command.communicate(timeout=300)
    assert command.returncode == 0, err[-3000:]
    parents = {(tmp_path / f"rank{r}").read_text() for r in range(2)}
    assert (parents == {str(command.pid)}) == NO_GPU, (parents, command.pid)


_FROM_STDIN = """
import unison
from unison.config import DistributedConfig, TrainConfig
cfg = TrainConfig(max_steps=1, batch_size=32, subset=128, signal_images=0, random_init_knn=False, knn=False,
                  progress=False, out={out!r}, distributed=DistributedConfig(world_size={world}))
print(unison.train(cfg).result_line())
"""


def test_a_script_piped_to_python_is_told_its_workers_need_a_file(tmp_path):
    """`python - < train.py` at two workers: each worker imports the script, `<stdin>`, which is no file. Before: two
    fork-server tracebacks (FileNotFoundError: '.../<stdin>'), then WorkerFailure; now one line before any worker
    starts, and the run directory is not touched. One worker trains in the process, which imports nothing."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-"], input=_FROM_STDIN.format(out=str(out), world=2), env=ENV, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "FileNotFoundError" not in proc.stderr and "WorkerFailure" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "unison.errors.ConfigError: the 2 worker processes start by importing the script that launched them, and this "
        "one is a script read from standard input: save it to a file and run it as python FILE.py, or use world_size=1 "
        "(training in this process, no workers)"), proc.stderr[-3000:]
    assert not out.exists()
    proc = subprocess.run([sys.executable, "-"], input=_FROM_STDIN.format(out=str(out), world=1), env=ENV, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "simclr x1 worker, 1 step" in proc.stdout, proc.stderr[-3000:]
