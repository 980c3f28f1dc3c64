"""Shared fixtures, and the layout of the suite.

* ``tests/unit/<package>/``: in-process tests, mirroring ``src/unison/<package>``; ``pytest tests/unit`` is the fast
  loop.
* ``tests/distributed/<package>/``: tests that start real processes (gloo worker processes on loopback, the
  launcher, torchrun, subprocesses); they carry the `distributed` marker, set here from their location, and the
  slowest end-to-end ones also carry `slow`.
* ``tests/helpers/``: what the unit and distributed tests of one module share; ``fault_helpers`` and
  ``fault_injection`` (the test-only training hook) stay at the top, where worker processes import them from.

A unit test whose source (or a fixture or module helper it uses) starts processes is an error at collection: it
belongs under ``tests/distributed/``.
"""

import gc
import inspect
import re
from pathlib import Path

import pytest
import torch

pytest_plugins = ["helpers.data_source", "helpers.data_stream"]   # fixtures shared by unit and distributed tests

TESTS = Path(__file__).resolve().parent
DISTRIBUTED = TESTS / "distributed"


@pytest.fixture(scope="module")
def one_torch_thread():
    # Tiny tensors: intra-op threads only add synchronisation (badly so on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_STARTS_PROCESSES = re.compile(r"run_in_workers|launch\(|main\(\[\s*\"(train|check|bench)\"|subprocess|torchrun|"
                               r"run_equivalence|run_curves|\btrain\(cfg|api import train|\"train\", \*")


def _source(obj) -> str:
    try:
        return inspect.getsource(getattr(obj, "__wrapped__", obj))
    except (OSError, TypeError):
        return ""


def _starts_processes(item) -> bool:
    own = _source(item.function)
    used = set(getattr(item, "fixturenames", ())) | set(re.findall(r"\b(_?[a-z]\w*)\(", own))
    helpers = [getattr(item.module, name, None) for name in used]   # its fixtures and module-level helpers
    sources = [own] + [_source(f) for f in helpers if callable(f) and getattr(f, "__module__", None) in
                       (item.module.__name__, None)]
    return any(_STARTS_PROCESSES.search(s) for s in sources)


# The files that take longest, run first, longest first; then the other files folder by folder: `scripts/test.sh`
# hands whole files to its pytest workers in this order (`--no-loadscope-reorder`: since 3.5, pytest-xdist otherwise
# hands out the files with the most tests first, whatever their length), and a long file handed out last leaves the
# other workers idle at the end. The order is that of `pytest -n 3 --durations=0`, summed per file; the run that
# `scripts/test.sh` prints (its slowest tests) says when a file belongs here or has moved.
LONGEST_FILES = (
    "unit/plan/test_plan.py",
    "distributed/cli/test_readme.py",
    "distributed/parallel/test_fsdp.py",
    "distributed/training/test_preemption.py",
    "distributed/training/test_compile.py",
    "distributed/bench/test_gpu_proof.py",
    "distributed/training/test_resume.py",
    "distributed/training/test_hang_bounds.py",
    "distributed/cluster/test_elastic.py",
    "distributed/training/test_dcp_checkpoint.py",
    "distributed/equivalence/test_accumulation.py",
    "distributed/training/test_faults.py",
    "distributed/cluster/test_slurm.py",
    "distributed/cli/test_train_outputs.py",
    "unit/training/test_defaults_matrix.py",
    "distributed/distributed/test_launch.py",
    "distributed/equivalence/test_check.py",
    "distributed/cluster/test_hosts.py",
    "distributed/cli/test_terminal.py",
    "distributed/cli/test_setup_script.py",
    "distributed/training/test_time_budget.py",
    "distributed/bench/test_bench_methods.py",
    "distributed/training/test_train.py",
    "distributed/methods/test_methods_vit.py",
    "distributed/docs/test_docs_site.py",
    "unit/training/test_signals.py",
    "distributed/training/test_watchdog.py",
    "distributed/cli/test_library_example.py",
    "unit/training/test_resume_replan.py",
    "unit/plan/test_plan_defaults.py",
    "distributed/cli/test_own_loop.py",
    "distributed/cli/test_bad_inputs.py",
    "distributed/training/test_disk_faults.py",
)
LONGEST_FIRST = ("distributed/training", "distributed/cluster", "distributed/parallel", "distributed/cli",
                 "distributed/methods", "distributed/equivalence")


def _run_order(item) -> int:
    path = Path(item.fspath).resolve()
    for i, name in enumerate(LONGEST_FILES):
        if path == TESTS / name:
            return i
    for i, folder in enumerate(LONGEST_FIRST, len(LONGEST_FILES)):
        if TESTS / folder in path.parents:
            return i
    return len(LONGEST_FILES) + len(LONGEST_FIRST) + (DISTRIBUTED not in path.parents)


def pytest_collection_modifyitems(items):
    items.sort(key=_run_order)   # stable: each file's tests stay together and in order
    misplaced = []
    for item in items:
        if DISTRIBUTED in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.distributed)
        elif _starts_processes(item):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("these tests start processes and belong under tests/distributed/: "
                                + ", ".join(misplaced))


def pytest_collection_finish(session):
    """What collection imported (torch, unison, the test modules: some 310,000 objects) is never garbage: out of
    every full collection from now on. Each pytest worker's garbage collection took 47 s of a 141 s run of
    tests/unit/{training,data,methods} on two workers, 19 s with this (129 s)."""
    gc.freeze()


@pytest.fixture
def run_env(monkeypatch):
    """The environment a test's `unison` run starts from, for the test files that start runs
    (``pytestmark = pytest.mark.usefixtures("run_env")``): no image cache (inherited by spawned workers, so that
    runs do not share decoded images through the cache folder), no fault injected and not a restart (a variable left
    by the shell or another test would change what the run does), and tests/fault_injection.py's hook registered
    for the workers a test injects faults into."""
    import fault_injection

    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    for var in (fault_injection.FAULT_ENV, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    fault_injection.register(monkeypatch)
