"""SLURM's node lists and the rendezvous port of a job step: pure functions of SLURM's variables.

* `expand_hostlist`: the compressed node-list syntax (``node[01-03,7],gpu-a[1-2]``), expanded lazily.
* `slurm_port`: a port for step S of job J, in [10000, 30000).

Used by `unison.distributed.env` to derive an srun step's rendezvous (see its docstring).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
MAX_HOSTLIST_CHARS = 1 << 16
MAX_HOST_RANGES = 16   # bracketed ranges in one host name (SLURM itself writes one or two)


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of step `step_id` of SLURM job `job_id`, in [10000, 30000).

    ``job * 31 + step`` modulo 20000 (31 is prime to 20000): step 0 of two jobs shares a port only when
    their numbers differ by a multiple of 20000, and steps 0-30 of jobs fewer than 645 apart never do.
    The range stays below Linux's ephemeral ports (32768 up), which outgoing connections hold."""
    return SLURM_PORT_BASE + (job_id * 31 + step_id) % SLURM_PORT_SPAN


_HOSTLIST_ITEM = re.compile(r"([^\[\],]*)(\[[^\[\]]*\])?")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> Iterator[str]:
    """The host names of a SLURM node list in its compressed syntax, in order: ``node[01-03,7],gpu-a[1-2]`` gives
    node01 node02 node03 node7 gpu-a1 gpu-a2 (zero padding kept; several brackets in a name expand as a product).
    The whole list is checked first, then names are made as they are walked: a list of a million nodes costs
    nothing until then. Raises ValueError on a malformed list.

    Why not ``scontrol show hostnames``: it is a process per rank and needs the SLURM client on the task's
    PATH, which containers started by srun (enroot, Apptainer) usually lack; the syntax is small."""
    if not text or len(text) > MAX_HOSTLIST_CHARS or not text.isascii() or any(c.isspace() for c in text):
        raise ValueError(text)
    items = [_parse_host_pattern(item, text) for item in _split_top_level(text)]
    return itertools.chain.from_iterable(_names(parts) for parts in items)


# A host pattern: literal text and number ranges (first, last, zero-padded width), in order.
_Part = str | list[tuple[int, int, int]]


def _parse_host_pattern(item: str, text: str) -> list[_Part]:
    parts: list[_Part] = []
    pos = 0
    while pos < len(item):
        m = _HOSTLIST_ITEM.match(item, pos)
        if m is None or m.end() == pos:
            raise ValueError(text)
        parts.append(m.group(1))
        if m.group(2):
            parts.append([_parse_range(r, text) for r in m.group(2)[1:-1].split(",")])
        pos = m.end()
        if len(parts) > 2 * MAX_HOST_RANGES:   # `_names` recurses once per part
            raise ValueError(text)
    return parts


def _parse_range(spec: str, text: str) -> tuple[int, int, int]:
    """``01-03`` -> (1, 3, 2): the width of the first number pads the others."""
    m = _RANGE.fullmatch(spec)
    if m is None:
        raise ValueError(text)
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if len(lo) > 12 or len(hi) > 12 or int(hi) < int(lo):
        raise ValueError(text)
    return int(lo), int(hi), len(lo)


def _names(parts: list[_Part]) -> Iterator[str]:
    """The names of one host pattern, made one at a time (itertools.product would build every range first)."""
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    choices = [head] if isinstance(head, str) else (str(n).zfill(w) for lo, hi, w in head for n in range(lo, hi + 1))
    for choice in choices:
        for tail in _names(rest):
            yield choice + tail


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise ValueError(text)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(text)
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(text)
    return items
