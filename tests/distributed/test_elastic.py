"""`unison.distributed.elastic.nodes_waiting`: whether a SIGTERM under torchrun is a scale-up, asked of a real c10d
rendezvous (torch's own handlers, in threads of this process: one node in a completed round, one waiting to join),
and the agent's options read from its command line. The whole scale-up under torchrun, on two hosts, is
tests/cluster/test_elastic.py."""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest

from unison.distributed import elastic


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun_job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")

    def agent(endpoint: str, nnodes: str = "1:2") -> None:
        options = argparse.Namespace(rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_id="job", nnodes=nnodes,
                                     rdzv_conf="join_timeout=30")
        monkeypatch.setattr(elastic, "agent_args", lambda cmdline=None: options)
    return agent


def test_a_node_waiting_to_join_is_counted_and_none_before_it(torchrun_job):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    endpoint = f"127.0.0.1:{_free_port()}"
    torchrun_job(endpoint)

    def node(host: bool):
        return get_rendezvous_handler(RendezvousParameters(
            backend="c10d", endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=2, is_host=str(host).lower(),
            join_timeout="20", last_call_timeout="1", close_timeout="5"))

    first = node(True)
    assert first.next_rendezvous().world_size == 1   # a group of one node (1 of 1:2 after the last call)
    assert elastic.nodes_waiting() == 0              # a SIGTERM now is not for a node joining
    joining = threading.Thread(target=lambda: node(False).next_rendezvous(), daemon=True)
    joining.start()                                  # waits for the next round, as a node joining a running job
    deadline = time.monotonic() + 30
    while elastic.nodes_waiting() != 1:              # what torchrun's agent reads before it restarts its workers
        assert time.monotonic() < deadline, "the joining node never showed in the rendezvous"
        time.sleep(0.2)


def test_where_it_cannot_be_known_it_is_none_and_bounded(torchrun_job, monkeypatch):
    torchrun_job(f"127.0.0.1:{_free_port()}")        # nothing listens there
    started = time.monotonic()
    assert elastic.nodes_waiting(timeout_s=1) is None
    assert time.monotonic() - started < 30           # a generous bound: unknown, not a hang
    torchrun_job("127.0.0.1:1", nnodes="2")          # a fixed node count: no scale-up to tell
    assert elastic.nodes_waiting() is None
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # not torchrun
    assert elastic.nodes_waiting() is None


@pytest.mark.parametrize("prefix", [["/venv/bin/python", "/venv/bin/torchrun"],
                                    ["python3", "-m", "torch.distributed.run"]], ids=["script", "module"])
def test_the_agents_options_come_from_its_command_line(prefix):
    cmdline = [*prefix, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               "198.18.0.1:29400", "--rdzv-id", "run-7", "--rdzv-conf", "is_host=1,last_call_timeout=3", "-m",
               "unison.cli", "train", "--out", "runs/x"]
    args = elastic.agent_args(cmdline)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("1:2", "c10d", "198.18.0.1:29400",
                                                                                  "run-7")
    assert elastic.agent_args(["/usr/bin/python3", "train.py", "--nnodes", "2"]) is None   # not torchrun's agent
