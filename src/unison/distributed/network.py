"""The network side of joining a group: which address and interface this host uses, stores that listen on one
address, and the store of a torchrun restart attempt.

* `gloo_interface`: unless ``GLOO_SOCKET_IFNAME`` is set, gloo uses the interface holding this host's address
  on the route to ``MASTER_ADDR`` (the rendezvous): loopback on one machine, the cluster's network on several.
* `listening_store`: torch's TCPStore server listens on every interface whatever host it is given; this one
  binds the socket itself and hands it over.
* `torchrun_attempt_store`: a fresh store per torchrun restart attempt, served by rank 0.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import secrets
import socket
import struct
import time

import torch.distributed as dist

from unison.config.distributed import DistributedConfig
from unison.config.fields import ascii_digits
from unison.errors import ConfigError, WorkerError


def listening_store(addr: str, port: int, world_size: int, timeout: datetime.timedelta,
                     wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server listening on `addr` only (port 0: a free one); see `unison.distributed.env._rendezvous_store`."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {addr}:{port} for the rendezvous ({exc.strerror}); "
                          "choose another --master-port or --master-addr") from None
    store = dist.TCPStore(addr, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                          master_listen_fd=sock.fileno(), wait_for_workers=wait_for_workers)
    sock.detach()  # the store serves on this descriptor from now on; Python must not close it
    return store


def _source_address(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent), or None when `host` is unreachable."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
            except OSError:
                continue
    return None


_SIOCGIFADDR = 0x8915


def _interface_with(addr: str) -> str | None:
    """The name of the network interface holding address `addr` (Linux), or None."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return None
    if ip.version == 6:   # /proc/net/if_inet6: "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
        try:
            with open("/proc/net/if_inet6") as f:
                rows = [line.split() for line in f.read(1 << 20).splitlines()]
        except OSError:
            return None
        return next((row[5] for row in rows if len(row) == 6 and row[0] == ip.exploded.replace(":", "")), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def gloo_interface(master_addr: str) -> str | None:
    """Point gloo at the interface through which this host reaches `master_addr` (``GLOO_SOCKET_IFNAME``, unless
    the user set it); the interface's name, or None when left to gloo.

    gloo otherwise takes the address of the host name, which in a container or network namespace may be
    an address the host does not have (gloo then falls back to loopback and its peers on other hosts get
    127.0.0.1), or another network than the cluster's. With it, gloo listens on that interface's address,
    not on every interface: loopback for a single machine (``MASTER_ADDR`` 127.0.0.1)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    source = _source_address(master_addr)
    name = _interface_with(source) if source else None
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name   # read by every gloo group this process creates
    return name


_ATTEMPT_PROBE_S = 2.0   # connecting to the store a dead rank 0 served fails (refused) within this


def torchrun_attempt_store(cfg: DistributedConfig, timeout: datetime.timedelta) -> dist.Store:
    """A fresh store for this restart attempt, served by rank 0 and announced through torchrun's shared store.

    Why: since torch 2.5 torchrun's agent serves the workers' store itself (``TORCHELASTIC_USE_AGENT_STORE``,
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and that server lives as long as the agent: it is
    created at the first rendezvous and reused for every restart. torch <= 2.4 gave each attempt its own
    key prefix (``/worker/attempt_N``); the fix of pytorch#135712 (PR #135957) removed the prefix on the
    assumption that every retry gets a new server, which torch 2.14's ``DynamicRendezvousHandler`` does
    not do. Restarted workers then share the namespace ``default_pg/`` with the dead ones and can read
    their gloo addresses: ``failed to connect ... Connection refused`` and a rendezvous that hangs until
    ``--timeout-s``. A prefix per attempt number does not
    do either: the number (``TORCHELASTIC_RESTART_COUNT``) is each agent's own count, and in a multi-node
    job only the failed node's agent counts a restart (a healthy one restarts its workers for the waiting
    node without counting), so the hosts' workers would use different prefixes and hang.

    So rank 0 serves a store of its own (on its address towards ``MASTER_ADDR``, not a wildcard) and
    publishes ``<nonce> <addr> <port>`` in the agent's store; the others connect to what is published.
    A stale announcement, a dead rank 0's, is recognised by its store being gone (by the time any worker
    of a round runs, every agent has stopped its previous workers) or not holding the nonce: they wait
    for the next one. https://github.com/pytorch/pytorch/issues/135712
    """
    agent = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=False, timeout=timeout)
    # per group size too: a group re-formed at another size never even reads the announcements of the previous one
    key = f"unison/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt_store/{cfg.world_size}"
    if cfg.rank == 0:
        addr = _source_address(cfg.master_addr) or cfg.master_addr
        nonce = secrets.token_hex(16)
        store = listening_store(addr, 0, cfg.world_size, timeout, wait_for_workers=False)
        store.set("unison/nonce", nonce)
        agent.set(key, f"{nonce} {addr} {store.port}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    stale: set[bytes] = set()
    while time.monotonic() < deadline:
        announced = agent.get(key) if agent.check([key]) else b""
        if announced and announced not in stale:
            joined = _attempt_store_at(announced, cfg.world_size, timeout)
            if joined is not None:
                return joined
            stale.add(announced)
        time.sleep(0.1)
    raise WorkerError(f"rank {cfg.rank} found no store of this restart attempt served by rank 0 (announced in "
                      f"torchrun's store at {cfg.master_addr}:{cfg.master_port}) within {cfg.timeout_s:g} s; "
                      "check that rank 0's worker started")


def _attempt_store_at(announced: bytes, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store rank 0 announced, or None when it is a dead attempt's (gone, or without the nonce)."""
    parts = announced.decode("ascii", "replace").split(" ")
    if len(parts) != 3 or not ascii_digits(parts[2]) or not 0 < int(parts[2]) < 65536 or len(parts[1]) > 253:
        return None
    nonce, addr, port = parts[0], parts[1], int(parts[2])
    probe = datetime.timedelta(seconds=_ATTEMPT_PROBE_S)
    try:   # a plain connect first: a dead store is refused at once, without torch's retries and log lines
        socket.create_connection((addr, port), timeout=_ATTEMPT_PROBE_S).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=probe, wait_for_workers=False)
        if store.get("unison/nonce").decode("ascii", "replace") != nonce:
            return None
    except (dist.DistError, RuntimeError):   # refused, unreachable, or not a store: a dead attempt's
        return None
    store.set_timeout(timeout)
    return store
