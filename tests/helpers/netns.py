"""Two hosts on this machine: network namespaces joined by a veth pair, for the several-hosts tests.

`two_hosts` creates namespaces ``uA<pid>``/``uB<pid>`` (names unique per test process), a veth pair between them
with 198.18.0.1/24 and 198.18.0.2/24 (RFC 2544's benchmarking range: no real network uses it) and ``lo`` up in
each, and always deletes them (which deletes the veth) at the end. The filesystem stays shared, as a cluster's
NFS would be. It skips with one line when not root, without iproute2 (installed on demand), or when the kernel
refuses namespaces (an unprivileged container). Traffic flows only between these two namespaces.

`sockets` reads a namespace's TCP table (/proc/<pid>/net/tcp{,6} of a process inside it) without starting one.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from helpers.system import ensure_programs, sbin

SUBNET = "198.18.0"


@dataclass(frozen=True)
class Host:
    netns: str
    addr: str

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return [sbin("ip"), "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sbin("ip"), *args], capture_output=True, text=True, timeout=30)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    return ensure_programs({"ip": "iproute2"})


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    if (reason := _netns_unavailable()) is not None:
        pytest.skip(reason)
    a, b = Host(f"uA{os.getpid()}", f"{SUBNET}.1"), Host(f"uB{os.getpid()}", f"{SUBNET}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            proc = _ip("netns", "add", host.netns)
            if proc.returncode != 0:
                pytest.skip(f"ip netns add failed: {proc.stderr.strip().splitlines()[-1:]}")
            created.append(host.netns)
        steps = [("link", "add", f"v{a.netns}", "type", "veth", "peer", "name", f"v{b.netns}")]
        for host in (a, b):
            steps += [("link", "set", f"v{host.netns}", "netns", host.netns),
                      ("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", f"v{host.netns}"),
                      ("-n", host.netns, "link", "set", f"v{host.netns}", "up"),
                      ("-n", host.netns, "link", "set", "lo", "up")]
        for step in steps:
            proc = _ip(*step)
            if proc.returncode != 0:
                pytest.skip(f"ip {' '.join(step)} failed: {proc.stderr.strip()}")
        yield a, b
    finally:
        for name in created:   # deleting a namespace deletes the veth end in it, and so the pair
            _ip("netns", "delete", name)


def _address(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host byte order) in the usual notation."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def sockets(pid: int) -> set[tuple[str, str, int, str, int]]:
    """(state, local address, local port, remote address, remote port) of every TCP socket in the network
    namespace of process `pid`; state is LISTEN or ESTABLISHED (others are left out)."""
    out = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:   # the process has ended
            continue
        for row in rows:
            fields = row.split()
            state = {"0A": "LISTEN", "01": "ESTABLISHED"}.get(fields[3])
            if state:
                (local, lport), (remote, rport) = (x.split(":") for x in fields[1:3])
                out.add((state, _address(local), int(lport, 16), _address(remote), int(rport, 16)))
    return out
