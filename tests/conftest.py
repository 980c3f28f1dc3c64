"""Shared fixtures, and the layout of the suite.

* ``tests/<package>/test_<subject>.py``: one file per subject, mirroring ``src/unison/<package>``, whatever
  processes its tests start. A test that starts real processes (gloo worker processes on loopback, the launcher,
  torchrun, subprocesses), in its own source or in a fixture or module helper it uses, carries the `distributed`
  marker, set here; a test can also carry it explicitly (when it starts them through another module's helper).
  The slowest end-to-end tests also carry `slow`. ``pytest -m "not distributed"`` is the fast loop.
* ``tests/helpers/``: what the test files of several subjects share; ``fault_helpers`` and ``fault_injection``
  (the test-only training hook) stay at the top, where worker processes import them from.
"""

import gc
import inspect
import re
from pathlib import Path

import pytest
import torch

pytest_plugins = ["helpers.data_source", "helpers.data_stream"]   # fixtures shared by several test files

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def one_torch_thread():
    # Tiny tensors: intra-op threads only add synchronisation (badly so on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# What starts processes: the launcher, worker pools, subprocesses, a training run (its default is 2 workers).
_STARTS_PROCESSES = re.compile(r"run_in_workers|launch\(|main\(\[\s*\"(train|check|bench)\"|subprocess|torchrun|"
                               r"run_equivalence|run_curves|run_side_process|\btrain\(cfg|api import train|\"train\", \*")


def _source(obj) -> str:
    try:
        return inspect.getsource(getattr(obj, "__wrapped__", obj))
    except (OSError, TypeError):
        return ""


def _in_tests(obj) -> bool:
    try:
        return TESTS in Path(inspect.getfile(getattr(obj, "__wrapped__", obj))).resolve().parents
    except (OSError, TypeError):
        return False


def _starts_processes(item) -> bool:
    """Whether the test, a fixture it uses (at any depth) or a module helper it calls starts processes."""
    own = _source(item.function)
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    called = [getattr(item.module, name, None) for name in set(re.findall(r"\b(_?[a-z]\w*)\(", own))]
    sources = [own] + [_source(f) for f in fixtures + called if callable(f) and _in_tests(f)]
    return any(_STARTS_PROCESSES.search(s) for s in sources)


# The files that take longest, run first, longest first; then the other files folder by folder: `scripts/test.sh`
# hands whole files to its pytest workers in this order (`--no-loadscope-reorder`: since 3.5, pytest-xdist otherwise
# hands out the files with the most tests first, whatever their length), and a long file handed out last leaves the
# other workers idle at the end. The order is that of `pytest -n 3 --durations=0`, summed per file; the run that
# `scripts/test.sh` prints (its slowest tests) says when a file belongs here or has moved.
LONGEST_FILES = (
    "plan/test_plan.py",
    "cli/test_readme.py",
    "parallel/test_fsdp.py",
    "training/test_preemption.py",
    "training/test_compile.py",
    "bench/test_gpu_proof.py",
    "training/test_resume.py",
    "training/test_hang_bounds.py",
    "cluster/test_elastic.py",
    "training/test_dcp_checkpoint.py",
    "equivalence/test_accumulation.py",
    "training/test_faults.py",
    "cluster/test_slurm.py",
    "cli/test_train_outputs.py",
    "training/test_defaults_matrix.py",
    "distributed/test_launch.py",
    "equivalence/test_check.py",
    "cluster/test_hosts.py",
    "cli/test_terminal.py",
    "cli/test_setup_script.py",
    "training/test_time_budget.py",
    "bench/test_bench_methods.py",
    "training/test_train.py",
    "methods/test_methods_vit.py",
    "docs/test_docs_site.py",
    "training/test_signals.py",
    "training/test_watchdog.py",
    "cli/test_library_example.py",
    "training/test_resume_replan.py",
    "plan/test_plan_defaults.py",
    "cli/test_own_loop.py",
    "cli/test_bad_inputs.py",
    "training/test_disk_faults.py",
)
LONGEST_FIRST = ("training", "cluster", "parallel", "cli", "methods", "equivalence")


def _run_order(item) -> int:
    path = Path(item.fspath).resolve()
    for i, name in enumerate(LONGEST_FILES):
        if path == TESTS / name:
            return i
    for i, folder in enumerate(LONGEST_FIRST, len(LONGEST_FILES)):
        if TESTS / folder in path.parents:
            return i
    return len(LONGEST_FILES) + len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=_run_order)   # stable: each file's tests stay together and in order
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.distributed)


def pytest_collection_finish(session):
    """What collection imported (torch, unison, the test modules: some 310,000 objects) is never garbage: out of
    every full collection from now on. Each pytest worker's garbage collection took 47 s of a 141 s run of
    the in-process tests of tests/{training,data,methods} on two workers, 19 s with this (129 s)."""
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
