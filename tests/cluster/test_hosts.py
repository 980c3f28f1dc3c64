"""unison on two real hosts: network namespaces joined by a veth pair (tests/helpers/netns.py), one torchrun each.

Host A (198.18.0.1) serves torchrun's c10d rendezvous; host B's worker is killed at step 3 (fault injection, set
only in B's environment). torchrun's elastic agents restart the group — B's agent counts a restart, A's restarts
its worker for the waiting node without counting — and the run resumes from its step-2 checkpoint in the shared
run directory and ends as the uninterrupted run does. While it runs the namespaces' TCP tables are sampled: the
rendezvous and gloo traffic go between 198.18.0.1 and 198.18.0.2, nothing on loopback, and only torchrun's own
stores (on host A) listen on a wildcard address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import fault_injection
import pytest
from fault_helpers import assert_same_training_state
from helpers.faults import FAULT
from helpers.netns import SUBNET, Host, sockets

from unison.training.checkpoint import load_checkpoint

from .conftest import TINY

TORCHRUN = Path(sys.executable).with_name("torchrun")
RDZV_PORT = 29400   # free: the namespaces are new
WILDCARDS = ("0.0.0.0", "::")


def _torchrun(host: Host, is_host: bool, run: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = host.command(str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"{SUBNET}.1:{RDZV_PORT}", "--rdzv-conf", f"is_host={int(is_host)}",
                       "--max-restarts", "1", "--local-addr", host.addr,
                       "-m", "unison.cli", "train", *TINY, "--out", str(run))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sample(procs: list[subprocess.Popen], seen: list[set], done: threading.Event) -> None:
    """Each namespace's TCP sockets, read every 0.2 s through its torchrun's /proc entry."""
    while not done.wait(0.2):
        for proc, table in zip(procs, seen):
            table |= sockets(proc.pid)


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_two_hosts_restart_a_killed_worker_and_resume_over_their_own_addresses(two_hosts, cluster_reference,
                                                                               tmp_path, monkeypatch):
    a, b = two_hosts
    fault_injection.register(monkeypatch)   # the hook is imported by every worker; only B's environment fires it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "GLOO_", "TORCH_DISABLE_SHARE"))}
    env.update(UNISON_NO_CACHE="1")
    env.pop(FAULT, None)
    run = tmp_path / "run"
    procs = [_torchrun(a, True, run, env), _torchrun(b, False, run, {**env, FAULT: "rank=1,step=3"})]
    seen: list[set] = [set(), set()]
    done = threading.Event()
    sampler = threading.Thread(target=_sample, args=(procs, seen, done), daemon=True)
    sampler.start()
    try:
        outputs = [proc.communicate(timeout=150) for proc in procs]
    finally:
        done.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sampler.join()
    (_, err_a), (_, err_b) = outputs
    assert [proc.returncode for proc in procs] == [0, 0], err_a[-3000:] + "\n----\n" + err_b[-3000:]
    assert "kill on rank 1 at step 3" in err_b
    # rank 0 (host A, whose agent counted no restart) resumes all the same: the workers agree on the attempt
    assert f"unison: restart 1: resuming from {run / 'checkpoints' / 'step_00000002.pt'}" in err_a, err_a[-3000:]
    assert_same_training_state(load_checkpoint(run), cluster_reference)
    _assert_traffic_between_the_hosts(*seen, a, b)


def _assert_traffic_between_the_hosts(on_a: set, on_b: set, a: Host, b: Host) -> None:
    for table, host in ((on_a, a), (on_b, b)):
        local = {s[1] for s in table}
        assert local <= {host.addr, *WILDCARDS}, (host, table)   # no loopback, no other address
    # B: only gloo listens (and on B's address); A: torchrun's rendezvous and agent stores on a wildcard (torch's
    # TCPStore binds one), unison's attempt store and gloo on A's address
    assert {s[1] for s in on_b if s[0] == "LISTEN"} == {b.addr}, on_b
    wild = {s[2] for s in on_a if s[0] == "LISTEN" and s[1] in WILDCARDS}
    assert RDZV_PORT in wild and len(wild) <= 2, on_a
    # gloo: a connection between the hosts to a listener at a host's own address (not the stores')
    for table, host, other in ((on_a, a, b), (on_b, b, a)):
        listeners = {(s[1], s[2]) for s in table if s[0] == "LISTEN" and s[1] == host.addr}
        if any(s[0] == "ESTABLISHED" and (s[1], s[2]) in listeners and s[3] == other.addr for s in table):
            return
    raise AssertionError(f"no connection between {a.addr} and {b.addr} to a host's own listener: {on_a} {on_b}")
