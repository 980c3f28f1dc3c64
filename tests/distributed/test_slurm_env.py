"""SLURM launches without rendezvous variables: the node-list parser, the port of a job step, what is detected
as an srun task, and the precedence of MASTER_*, --master-* and what srun implies (unison.distributed.env, unison.distributed.hostlist)."""

from __future__ import annotations

import pytest

from unison.config.distributed import DistributedConfig
from unison.distributed.env import apply_launch_env, detect_launch_env, slurm_rendezvous
from unison.distributed.hostlist import SLURM_PORT_BASE, SLURM_PORT_SPAN, expand_hostlist, slurm_port
from unison.errors import ConfigError

# What SLURM 22.05 set, recorded on a one-node test cluster: an srun task (srun -n2), and the shell of
# `sbatch -n2` (rank and task count, but no job step).
SRUN_TASK = {"SLURM_JOB_ID": "17", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "vm",
             "SLURM_JOB_NODELIST": "vm", "SLURM_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1"}
BATCH_SHELL = {"SLURM_JOB_ID": "18", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
               "SLURM_NPROCS": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_NODELIST": "vm", "SLURM_TASK_PID": "31749"}


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,7],gpu-a[1-2]", ["node01", "node02", "node03", "node7", "gpu-a1", "gpu-a2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b[3],c.example.org", ["a", "b3", "c.example.org"]),
])
def test_hostlist_expands_like_scontrol_show_hostnames(text, hosts):
    assert list(expand_hostlist(text)) == hosts


@pytest.mark.parametrize("text", ["", "a[1-", "a]", "a[3-1]", "a,,b", ",a", "a,", "a[x]", "a[]", "a b", "a[[1]]",
                                  "a[1-2", "n[1-99999999999999]", "é", "x" * 70000,
                                  "a[1]" * 17])
def test_malformed_hostlist_is_refused(text):
    with pytest.raises(ValueError):
        list(expand_hostlist(text))


def test_a_huge_hostlist_costs_nothing_until_walked():
    assert next(expand_hostlist("n[1-999999999999]")) == "n1"


def test_port_of_a_step_is_in_range_and_differs_between_steps_and_near_jobs():
    ports = {(job, step): slurm_port(job, step) for job in range(1000, 1645) for step in range(31)}
    assert all(SLURM_PORT_BASE <= p < SLURM_PORT_BASE + SLURM_PORT_SPAN for p in ports.values())
    assert len(set(ports.values())) == len(ports)   # steps 0-30 of jobs fewer than 645 apart never collide
    assert slurm_port(7, 0) == slurm_port(7, 0) and slurm_port(7, 0) != slurm_port(7, 1)
    assert max(slurm_port(2**64 - 1, s) for s in range(3)) < 30000


def test_rendezvous_is_loopback_on_one_node_and_the_first_host_on_several():
    assert slurm_rendezvous(SRUN_TASK) == ("127.0.0.1", slurm_port(17, 0))
    several = {**SRUN_TASK, "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-08]"}
    assert slurm_rendezvous(several)[0] == "gpu07"   # the step's nodes, not the job's
    job_only = {k: v for k, v in several.items() if k != "SLURM_STEP_NODELIST"}
    assert slurm_rendezvous(job_only)[0] == "gpu01"
    assert slurm_rendezvous({"SLURM_STEP_ID": "0"}) == (None, None)


def test_malformed_node_list_is_one_line_naming_the_variable_and_the_fix():
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST='n\[1-' is not a SLURM node list .*set MASTER_ADDR"):
        detect_launch_env({**SRUN_TASK, "SLURM_STEP_NODELIST": "n[1-"})
    assert detect_launch_env({**SRUN_TASK, "SLURM_STEP_NODELIST": "n[1-", "MASTER_ADDR": "n1"}).master_addr == "n1"


def test_srun_task_is_a_slurm_worker_and_the_batch_shell_is_not():
    task = detect_launch_env(SRUN_TASK)
    assert task is not None and (task.rank, task.world_size, task.local_rank, task.source) == (1, 2, 1, "slurm")
    assert (task.master_addr, task.master_port) == (None, None)   # nothing given: derived ones are defaults only
    assert (task.default_addr, task.default_port) == ("127.0.0.1", slurm_port(17, 0))
    assert detect_launch_env(BATCH_SHELL) is None   # `unison train` in an sbatch script starts its own workers
    old = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}   # SLURM_STEPID only (older SLURM)
    assert detect_launch_env(old) is not None


@pytest.mark.parametrize("env, flags, expected", [
    ({}, {}, ("node01", None)),
    ({"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500"}, {"master_addr": "10.1.1.1", "master_port": 1234},
     ("10.0.0.9", 29500)),
    ({}, {"master_addr": "10.1.1.1", "master_port": 1234}, ("10.1.1.1", 1234)),
])
def test_precedence_is_variables_then_flags_then_srun(env, flags, expected):
    srun = {**SRUN_TASK, "SLURM_STEP_NODELIST": "node[01-02]", **env}
    cfg = apply_launch_env(DistributedConfig(**flags), detect_launch_env(srun))
    assert (cfg.master_addr, cfg.master_port) == (expected[0], expected[1] or slurm_port(17, 0))
    assert (cfg.rank, cfg.world_size) == (1, 2)


def test_every_srun_task_of_a_step_derives_the_same_rendezvous():
    tasks = [{**SRUN_TASK, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2)} for r in range(2)]
    assert len({(e.default_addr, e.default_port) for e in map(detect_launch_env, tasks)}) == 1


@pytest.mark.parametrize("value, reason", [("1", "SLURM requeue 1"), ("0", None), ("²", None), ("٣", None),
                                           ("9" * 5000, None)])
def test_a_requeue_count_is_ascii_digits(monkeypatch, value, reason):
    """'²'.isdigit() is True and int('²') a ValueError; '٣' reads as 3; 5,000 digits are past int()'s limit."""
    from unison.distributed.env import restart_reason

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    assert restart_reason() == reason
