"""A real one-node SLURM cluster (munged, slurmctld, slurmd) in a temporary folder, for the cluster tests.

Everything lives under the folder: the munge key and socket, slurm.conf, state, spool, logs and pid files; the
daemons run in the foreground as children of the test process (as root: ``SlurmUser=root``), on free high ports,
and are ended by their process ids when the cluster stops, so nothing of the machine's own SLURM (if any) is used
or touched. Clients (srun, sbatch, sinfo) find it through ``SLURM_CONF`` in `SlurmCluster.env`.

Choices, and why:
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, no accounting: no cgroups, which containers and
  CI machines often lack.
* The node declares at least 8 CPUs (``SlurmdParameters=config_overrides`` lets it claim more than the machine has)
  and the partition is ``OverSubscribe=FORCE``: a test never waits for resources on a 2-core machine.
* ``cred_expire=5`` (in ``AuthInfo``): a requeued job waits this long before it may start again (default 120 s).
* ``NodeAddr=127.0.0.1``: the daemons talk over loopback, whatever the machine's host name resolves to.
* ``FirstJobId`` random: unison derives the rendezvous port from the job id, so two test sessions on one machine
  (each with its own cluster, counting jobs from the same first id) would otherwise ask for the same ports.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.system import ensure_programs, sbin

PROGRAMS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client", "sbatch": "slurm-client",
            "sinfo": "slurm-client", "squeue": "slurm-client", "scontrol": "slurm-client", "scancel": "slurm-client",
            "munged": "munge"}
START_TIMEOUT_S = 30.0


def skip_reason() -> str | None:
    """Why a real SLURM cluster cannot be started here (one line), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a private SLURM cluster runs its daemons as root (SlurmUser=root); run the tests as root"
    return ensure_programs(PROGRAMS)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SlurmCluster:
    root: Path
    node: str = field(default_factory=socket.gethostname)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment for a SLURM client of this cluster (no rendezvous variables)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "OMPI_", "PMI_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_config(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        cpus = max(8, os.cpu_count() or 1)
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "plugstack.conf").write_text("")
        r = self.root
        self.conf.write_text(f"""\
ClusterName=unisontest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
PlugStackConfig={r}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
FirstJobId={random.randrange(1000, 1_000_000)}
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=unison Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")

    def _spawn(self, argv: list[str], log: str) -> None:
        out = open(self.root / log, "ab")   # noqa: SIM115 (the child keeps it open)
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL))
        out.close()

    def start(self) -> None:
        self._write_config()
        m = self.root / "munge"
        self._spawn([sbin("munged"), "--foreground", "--force", f"--socket={m}/munge.socket",
                     f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                     f"--seed-file={m}/munged.seed"], "munged.out")
        self._wait_for(lambda: (m / "munge.socket").exists(), "munged's socket")
        self._spawn([sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._spawn([sbin("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)], "slurmd.out")
        self._wait_for(self._node_idle, "the node to be idle in sinfo")

    def _node_idle(self) -> bool:
        proc = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=10)
        return proc.returncode == 0 and proc.stdout.strip().startswith("idle")

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "; ".join(f"{p.name}: {p.read_text()[-600:]}" for p in sorted(self.root.glob("*.log")))
                self.stop()
                raise RuntimeError(f"SLURM test cluster: no {what} ({'exited: ' + ', '.join(dead) if dead else 'timeout'}"
                                   f"); {logs}")
            time.sleep(0.2)

    def run(self, argv: list[str], check: bool = True, timeout: float = 120, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster; its stdout/stderr as text."""
        proc = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc

    def job_state(self, job: str) -> str:
        """STATE of `job` as scontrol shows it (PENDING, RUNNING, COMPLETED, ...)."""
        out = self.run(["scontrol", "show", "job", job], check=False, timeout=10).stdout
        m = re.search(r"JobState=(\w+)", out)
        return m.group(1) if m else "UNKNOWN"

    def stop(self) -> None:
        """Cancel every job, end the daemons by their process ids, then any process of this cluster left (job
        steps outlive slurmd: slurmstepd and the tasks are recognised by this cluster's SLURM_CONF)."""
        if self.procs and all(p.poll() is None for p in self.procs):
            self.run(["scancel", "--full", "--partition=unison"], check=False, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False, timeout=10).stdout.strip():
                time.sleep(0.2)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for pid in self._leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _leftovers(self) -> list[int]:
        """Processes other than this one whose environment names this cluster's slurm.conf."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    continue
        return found
