"""What unison derives from a launcher's variables: mpirun's rendezvous, the gloo interface, torchrun's attempt store.

In-process only; the attempt store is tested in tests/distributed/test_attempt_store.py, the real
mpirun and the two-host torchrun in tests/cluster/.
"""

from __future__ import annotations

import os
import zlib

import pytest

from unison.config.distributed import DistributedConfig
from unison.distributed import env as E
from unison.distributed import launch_env as L
from unison.errors import ConfigError

OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "453378049"}


def _applied(environ: dict[str, str], **cfg) -> DistributedConfig:
    launch = E.detect_launch_env(environ)
    assert launch is not None
    return E.apply_launch_env(DistributedConfig(**cfg), launch)


def test_mpirun_on_one_node_needs_no_master_variables():
    cfg = _applied(OMPI)
    low, high = L.MPI_PORT_RANGE
    assert (cfg.rank, cfg.world_size, cfg.master_addr) == (1, 2, "127.0.0.1")
    assert low <= cfg.master_port <= high
    assert _applied({**OMPI, "OMPI_COMM_WORLD_RANK": "0"}).master_port == cfg.master_port   # every rank agrees
    assert _applied({**OMPI, "OMPI_MCA_ess_base_jobid": "453378050"}).master_port != cfg.master_port   # per job
    assert cfg.backend == "mpi" and cfg.communication_backend(cuda_available=False) == "gloo"   # auto: as --backend mpi


def test_open_mpi_5_and_pmix_name_the_job_by_namespace():
    environ = {k: v for k, v in OMPI.items() if k != "OMPI_MCA_ess_base_jobid"}
    ours = _applied({**environ, "PMIX_NAMESPACE": "prterun-node1-4242@1"}).master_port
    assert ours == L.MPI_PORT_RANGE[0] + zlib.crc32(b"prterun-node1-4242@1") % 10000
    assert _applied({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "PMIX_NAMESPACE": "j"}).master_port


def test_given_rendezvous_values_win_over_derived_ones():
    assert _applied({**OMPI, "MASTER_PORT": "12345"}).master_port == 12345
    assert _applied(OMPI, master_port=23456).master_port == 23456   # --master-port
    several = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert _applied({**several, "MASTER_ADDR": "10.1.2.3"}).master_addr == "10.1.2.3"
    assert _applied(several, master_addr="node07").master_addr == "node07"   # --master-addr


@pytest.mark.parametrize("environ, fragment", [
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "several nodes, so the rendezvous cannot be on loopback (127.0.0.1); "
     "give every rank rank 0's host: mpirun -x MASTER_ADDR=<rank 0's host>"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_ADDR": "localhost"}, "cannot be on loopback (localhost)"),
    ({k: v for k, v in OMPI.items() if k != "OMPI_MCA_ess_base_jobid"}, "no rendezvous port: this mpirun names no job "
     "(none of OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE is set) to derive one from; pass one to every rank: mpirun -x "
     "MASTER_PORT=<port>"),
])
def test_mpirun_rendezvous_that_cannot_work_is_one_line(environ, fragment):
    with pytest.raises(ConfigError) as err:
        _applied(environ)
    assert fragment in str(err.value)


@pytest.mark.parametrize("environ", [{}, {"RANK": "0", "WORLD_SIZE": "1"}])
def test_backend_mpi_needs_an_mpi_launcher(environ):
    launch = E.detect_launch_env(environ)
    with pytest.raises(ConfigError, match=r"--backend mpi is for workers started by mpirun \(or srun\)"):
        E.check_backend_launcher(DistributedConfig(backend="mpi"), launch)
    E.check_backend_launcher(DistributedConfig(backend="mpi"), E.detect_launch_env(OMPI))
    E.check_backend_launcher(DistributedConfig(backend="gloo"), None)


def test_gloo_uses_the_interface_towards_the_rendezvous(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    loopback = E._interface_with("127.0.0.1")
    assert loopback and E._source_address("127.0.0.1") == "127.0.0.1"
    assert E.gloo_interface("127.0.0.1") == loopback   # one machine: loopback, as before
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")   # the user's choice stands
    assert E.gloo_interface("127.0.0.1") is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert E._interface_with("198.18.255.254") is None and E._source_address("no-such-host.invalid") is None


def test_full_sharding_on_one_cuda_worker_is_refused_where_the_device_is_known(monkeypatch):
    """One CUDA worker talks over an in-process gloo group, whose FSDP collectives on CUDA tensors killed the
    workers on an H100. Refused when the worker picks its device, not in the configuration, which may be written
    on a machine without the GPU it runs on (and a checkpoint of a CPU run with --shard full stays readable)."""
    import torch

    from unison.config.distributed import DistributedConfig
    from unison.distributed.env import init_distributed
    from unison.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as info:
        init_distributed(DistributedConfig(world_size=1, shard="full"))
    assert "--shard none" in str(info.value) and "\n" not in str(info.value)
    assert not torch.distributed.is_initialized()   # refused before any process group exists
    DistributedConfig(world_size=1, shard="full").validate(cuda_available=True)   # the configuration itself is fine
