"""Elastic membership under torchrun (``--nnodes MIN:MAX``): is this group a re-formed group of a job that ran before?

torchrun's elastic agent restarts its workers in two cases. After a failure it counts a restart
(``TORCHELASTIC_RESTART_COUNT``, each agent its own count). When a node is waiting to join
(``num_nodes_waiting() > 0``: a scale-up) it restarts the workers of every node *without* counting one, so
the count alone cannot say that the new workers belong to a job that already trained: they would start over.

Nor can a store: the workers' store (``MASTER_ADDR:MASTER_PORT``) is served by the agent of the node that
was rank 0 when it was created, and a node that becomes rank 0 after that one is lost serves a new, empty one;
the rendezvous store is not named to the workers. What outlives every group is the run directory, shared by
all nodes. So rank 0 of every group keeps a record there, ``torchrun_group.json``: the job (the SHA-256 of
``TORCHELASTIC_RUN_ID``, torchrun's ``--rdzv-id``), its number of workers and the steps it has done
(`note_progress`: a rewrite of one fixed-size line after every optimiser step, no fsync). The id is stored as its
hash, not as given: an id may have any length and any characters, and the line has a fixed size, so the id itself
would be cut (a long one) or escaped past the line's end (``\u00e9``: six bytes a letter), and the group would not
recognise its own job; a hash of the whole id is what the reader compares, whatever the id. A group whose run
directory holds the record of its own job id, unfinished, is a re-formed group of that job (`previous_group`),
and resumes from the run directory's last checkpoint like a restarted one. Give every job its own
``--rdzv-id``: torchrun's default, ``none``, is the same for all, so a new job started with it in the run
directory of an earlier one that did not finish continues that run.

A scale-up reaches the workers as a SIGTERM, as a preemption does. `nodes_waiting` tells them apart: it asks the
job's rendezvous (c10d, the endpoint and id of the agent's own command line, as torchrun's agent itself asks it
before it restarts its workers) how many nodes wait to join; while the workers stop for them, they wait.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .collectives import is_distributed

RECORD = "torchrun_group.json"
_WIDTH = 255   # the record is one line of this many bytes (and a newline), rewritten in place


@dataclass(frozen=True)
class PreviousGroup:
    """The group of this torchrun job that ran before this one: its number of workers and the steps it did."""

    world_size: int
    step: int


_previous: PreviousGroup | None = None
_record: tuple[int, str, int] | None = None   # rank 0 of a torchrun group: (open record file, job id, world size)


def torchrun_job() -> str | None:
    """torchrun's id of this job (``--rdzv-id``), None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") if "TORCHELASTIC_RESTART_COUNT" in os.environ else None


def job_digest(job: str) -> str:
    """What the record keeps of a job id: the SHA-256 of its UTF-8 bytes, in hex (64 ASCII characters whatever the
    id; an id that is not valid UTF-8 reaches Python as surrogates, which are hashed as they came)."""
    return hashlib.sha256(job.encode("utf-8", "surrogateescape")).hexdigest()


def _read(path: Path, job: str) -> PreviousGroup | None:
    """The group the record at `path` describes, if it is one of job `job`."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_WIDTH + 1))
        if data.get("job_sha256") == job_digest(job) and not data.get("done"):   # a finished job: continued by no one
            return PreviousGroup(int(data["world_size"]), int(data["step"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):   # none, or not one of ours: a first group
        pass
    return None


def _write(fd: int, job: str, world: int, step: int, done: bool = False) -> None:
    line = json.dumps({"job_sha256": job_digest(job), "world_size": world, "step": step,
                       **({"done": True} if done else {})})   # ASCII, at most 130 bytes: it always fits
    os.pwrite(fd, line.ljust(_WIDTH).encode("ascii") + b"\n", 0)


def recorded_here(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds the record of this torchrun job (no collective: the pre-flight of a re-formed group's
    workers, before they join, knows that they will resume)."""
    job = torchrun_job()
    return job is not None and _read(Path(run_dir) / RECORD, job) is not None


def join_elastic(run_dir: str | Path, device: torch.device) -> None:
    """Every worker of a torchrun group, before restoring: learn the group of this job that ran before (rank 0
    reads the run directory's record and tells the others) and record this one. Collective; nothing outside
    torchrun."""
    global _previous, _record
    if _record is not None:   # an earlier run in this process
        os.close(_record[0])
    _previous, _record = None, None
    job = torchrun_job()
    if job is None:
        return
    world, found = dist.get_world_size(), [-1, -1]
    if dist.get_rank() == 0:
        path = Path(run_dir) / RECORD
        previous = _read(path, job)
        if previous is not None:
            found = [previous.world_size, previous.step]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        _write(fd, job, world, max(found[1], 0))
        _record = (fd, job, world)
    values = torch.tensor(found, dtype=torch.int64, device=device)
    dist.broadcast(values, src=0)
    _previous = PreviousGroup(int(values[0]), int(values[1])) if int(values[0]) > 0 else None


def previous_group() -> PreviousGroup | None:
    """The group of this torchrun job that ran before this one (None: this is its first, or not torchrun). What
    `join_elastic` learnt belongs to the group it joined: once the process has left it, None."""
    return _previous if is_distributed() else None


def note_progress(step: int, done: bool = False) -> None:
    """Rank 0 of a torchrun group: this group has done `step` optimiser steps (for a group that may follow);
    `done`: the run is complete (its last checkpoint written), so a later job with the same id starts afresh."""
    global _record
    if _record is None:
        return
    fd, job, world = _record
    try:
        _write(fd, job, world, step, done)
    except OSError:   # a full or gone disk: the checkpoints fail too, and say so
        _record = None


NODES_WAITING_TIMEOUT_S = 5   # bound on reaching the rendezvous store (a lost endpoint: unknown, not a hang)


def nodes_waiting(timeout_s: int = NODES_WAITING_TIMEOUT_S) -> int | None:
    """Under torchrun with an elastic node range (``--nnodes MIN:MAX``, the c10d rendezvous): how many nodes wait to
    join this job's group now. More than 0 while the workers are stopped: the agents are restarting them to re-form
    the group with those nodes (a scale-up), not preempting the job. None where it cannot be known (not torchrun,
    a fixed node count, another rendezvous backend, the endpoint not reached within `timeout_s`)."""
    if torchrun_job() is None:
        return None
    args = agent_args()
    if args is None or getattr(args, "rdzv_backend", None) != "c10d" or not getattr(args, "rdzv_endpoint", None):
        return None
    try:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
        from torch.distributed.run import parse_min_max_nnodes

        low, high = parse_min_max_nnodes(str(args.nnodes))
        if low == high:
            return None
        conf = dict(item.split("=", 1) for item in str(args.rdzv_conf or "").split(",") if "=" in item)
        params = RendezvousParameters(backend="c10d", endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                                      min_nodes=low, max_nodes=high,
                                      **{**conf, "is_host": "false", "read_timeout": str(timeout_s)})
        return int(get_rendezvous_handler(params).num_nodes_waiting())
    except Exception:   # unreachable, refused, another torch's layout: the wording of a preemption stands
        return None


def agent_args(cmdline: list[str] | None = None) -> Any:
    """torchrun's parsed options (its own parser, `PET_*` defaults from the environment the workers inherit) from
    the command line of this worker's parent, torchrun's agent (`cmdline`: given, for tests); None if the parent
    is not torchrun."""
    if cmdline is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                cmdline = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:   # not Linux, or the agent is gone
            return None
    start = next((i + 1 for i, a in enumerate(cmdline) if os.path.basename(a) == "torchrun"), None)
    if start is None:
        start = next((i + 2 for i, a in enumerate(cmdline[:-1])
                      if a == "-m" and cmdline[i + 1] in ("torch.distributed.run", "torch.distributed.launch")), None)
    if start is None:
        return None
    from torch.distributed.run import get_args_parser

    try:
        return get_args_parser().parse_known_args(cmdline[start:])[0]
    except SystemExit:   # a command line torchrun's parser refuses: not the agent's
        return None
