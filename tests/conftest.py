"""Shared fixtures, and the `distributed` marker for tests that start real processes."""

import inspect
import re

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    # Tiny tensors: intra-op threads only add synchronisation (badly so on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Tests that start real worker processes (gloo on loopback, the launcher, torchrun, subprocesses) carry the
# `distributed` marker; the rest are fast in-process unit tests. `pytest -m "not distributed"` runs the unit
# tests alone; CI runs both. A test is distributed when it, a fixture or a helper function of its module it
# calls does one of these.
_STARTS_PROCESSES = re.compile(r"run_in_workers|launch\(|main\(\[\s*\"(train|check|bench)\"|subprocess|torchrun|"
                               r"run_equivalence|run_curves|\btrain\(cfg|api import train|\"train\", \*")


def _source(obj) -> str:
    try:
        return inspect.getsource(getattr(obj, "__wrapped__", obj))
    except (OSError, TypeError):
        return ""


def pytest_collection_modifyitems(items):
    for item in items:
        own = _source(item.function)
        used = set(getattr(item, "fixturenames", ())) | set(re.findall(r"\b(_?[a-z]\w*)\(", own))
        helpers = [getattr(item.module, name, None) for name in used]   # its fixtures and module-level helpers
        sources = [own] + [_source(f) for f in helpers if callable(f) and getattr(f, "__module__", None) in
                           (item.module.__name__, None)]
        if any(_STARTS_PROCESSES.search(s) for s in sources):
            item.add_marker(pytest.mark.distributed)
