"""torchrun's shared store and unison's store per restart attempt (`unison.distributed.env.
torchrun_attempt_store`), in this process: rank 0 and rank 1 in two threads, a dead attempt's announcement left in
the agent's store."""

from __future__ import annotations

import datetime
import socket
import threading

import torch.distributed as dist

from unison.config.distributed import DistributedConfig
from unison.distributed import env as N


def _timeout(seconds: float = 20) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_attempt_store_skips_a_dead_attempts_announcement(monkeypatch):
    """Workers of one round meet in rank 0's store whatever their agents' restart counts; an announcement left
    by a dead rank 0 (its store gone) is skipped, not joined."""
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=_timeout(), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    agent.set("unison/job/attempt_store", f"{'0' * 32} 127.0.0.1 {_dead_port()}")   # attempt 0's rank 0, dead
    cfg = DistributedConfig(backend="gloo", world_size=2, master_port=agent.port)
    joined: list[dist.Store] = []
    rank1 = threading.Thread(target=lambda: joined.append(N.torchrun_attempt_store(
        DistributedConfig(backend="gloo", world_size=2, rank=1, master_port=agent.port), _timeout())))
    rank1.start()
    ours = N.torchrun_attempt_store(cfg, _timeout())   # rank 0 of this attempt: a fresh store on 127.0.0.1
    rank1.join(30)
    assert joined, "rank 1 did not join"
    ours.set("from_rank_0", "hello")
    assert joined[0].get("from_rank_0") == b"hello"
    assert N._attempt_store_at(b"garbage", 2, _timeout()) is None
    nonce, addr, port = agent.get("unison/job/attempt_store").decode().split()
    assert N._attempt_store_at(f"{'f' * 32} {addr} {port}".encode(), 2, _timeout()) is None   # another attempt's
