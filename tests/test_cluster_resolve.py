"""resolve_cluster over constructed environments: precedence, torchrun, SLURM, host lists."""

from __future__ import annotations

import doctest
import importlib
import json

import pytest

from stratagem.cluster import (
    expand_nodelist,
    expand_tasks_per_node,
    parse_tf_config,
    resolve_cluster,
    slurm_master_port,
)
from stratagem.errors import ClusterError

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.1.1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[08-09]",
}
TF_CONFIG = json.dumps({"cluster": {"worker": ["a:1000", "b:1000"]}, "task": {"type": "worker", "index": 1}})


def test_nothing_set_is_a_single_process():
    cluster = resolve_cluster(env={"HOME": "/root"})
    assert (cluster.source, cluster.rank, cluster.world_size, cluster.local_rank) == ("single-process", 0, 1, 0)
    assert cluster.is_chief and not cluster.is_distributed
    assert "one process" in cluster.explain()


def test_empty_tf_config_counts_as_unset():
    assert resolve_cluster(env={"TF_CONFIG": "  "}).source == "single-process"


def test_explicit_cluster_wins_and_says_what_it_shadows():
    explicit = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "chief", "index": 0}}
    cluster = resolve_cluster(explicit, env={"TF_CONFIG": TF_CONFIG, **TORCHRUN})
    assert (cluster.source, cluster.task_name, cluster.rank) == ("explicit", "chief:0", 0)
    assert cluster.evidence[-1] == "explicit takes precedence over TF_CONFIG, torchrun (also set)"
    same = parse_tf_config(explicit)
    assert resolve_cluster(same, env=TORCHRUN) is same


def test_explicit_of_the_wrong_type():
    with pytest.raises(ClusterError, match=r"must be a Cluster or a dict in TF_CONFIG form\. Received: str '\{\}'"):
        resolve_cluster("{}", env={})


def test_tf_config_wins_over_torchrun_and_slurm():
    env = {"TF_CONFIG": TF_CONFIG, "RANK": "1", "WORLD_SIZE": "2", **{k: v for k, v in SLURM.items()}}
    cluster = resolve_cluster(env=env)
    assert (cluster.source, cluster.rank, cluster.master_addr, cluster.master_port) == ("TF_CONFIG", 1, "a", 1000)
    assert "TF_CONFIG takes precedence over torchrun, SLURM (also set)" in cluster.explain()


def test_tf_config_and_torchrun_must_agree():
    with pytest.raises(
        ClusterError,
        match=r"TF_CONFIG and torchrun's variables disagree\. Received: TF_CONFIG "
        r"gives worker:1 rank 1 of 2, RANK=0, WORLD_SIZE=2",
    ):
        resolve_cluster(env={"TF_CONFIG": TF_CONFIG, "RANK": "0", "WORLD_SIZE": "2"})


def test_malformed_tf_config_in_the_environment_is_an_error_not_a_fallback():
    with pytest.raises(ClusterError, match=r"TF_CONFIG is not valid JSON"):
        resolve_cluster(env={"TF_CONFIG": "{oops", **TORCHRUN})


def test_torchrun():
    cluster = resolve_cluster(env=TORCHRUN)
    assert (cluster.source, cluster.task_name, cluster.rank, cluster.world_size) == ("torchrun", "worker:3", 3, 4)
    assert (cluster.local_rank, cluster.local_world_size) == (1, 2)
    assert (cluster.master_addr, cluster.master_port, cluster.chief_address) == ("10.1.1.1", 29500, "10.1.1.1:29500")
    assert not cluster.is_chief and cluster.addresses == {}
    assert "RANK=3" in cluster.explain() and cluster.task_for_rank(0) == "worker:0"


def test_torchrun_wins_over_slurm():
    assert resolve_cluster(env={**SLURM, **TORCHRUN}).source == "torchrun"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"MASTER_PORT": None, "LOCAL_RANK": None},
            r"torchrun's variables are only partly set: LOCAL_RANK, MASTER_PORT missing\. Received: \{'RANK': '3'",
        ),
        ({"RANK": "one"}, r"RANK is not an integer >= 0\. Received: RANK='one'\. Set RANK to a whole number"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE is not an integer >= 1\. Received: WORLD_SIZE='0'"),
        (
            {"RANK": "4"},
            r"RANK must be smaller than WORLD_SIZE\. Received: RANK=4, WORLD_SIZE=4\. Give each of "
            r"the 4 processes a distinct RANK in 0\.\.3",
        ),
        ({"LOCAL_RANK": "2"}, r"LOCAL_RANK must be smaller than LOCAL_WORLD_SIZE\. Received: LOCAL_RANK=2"),
        (
            {"LOCAL_WORLD_SIZE": "8"},
            r"LOCAL_WORLD_SIZE cannot exceed WORLD_SIZE\. Received: LOCAL_WORLD_SIZE=8, WORLD_SIZE=4",
        ),
        ({"MASTER_ADDR": " "}, r"MASTER_ADDR is empty"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT is not a valid port\. Received: MASTER_PORT=70000"),
    ],
)
def test_torchrun_errors(change, message):
    env = {**TORCHRUN, **{k: v for k, v in change.items() if v is not None}}
    for key in [k for k, v in change.items() if v is None]:
        del env[key]
    with pytest.raises(ClusterError, match=message):
        resolve_cluster(env=env)


def test_world_size_alone_is_a_half_set_torchrun_error():
    with pytest.raises(ClusterError, match=r"only partly set: RANK, LOCAL_RANK"):
        resolve_cluster(env={"WORLD_SIZE": "2"})


def test_slurm():
    cluster = resolve_cluster(env=SLURM)
    assert (cluster.source, cluster.task_name, cluster.rank, cluster.world_size) == ("SLURM", "worker:5", 5, 8)
    assert (cluster.local_rank, cluster.local_world_size) == (1, 4)
    # The step's node list wins over the job's; 20000 + 123456 % 10000 = 23456.
    assert (cluster.master_addr, cluster.master_port) == ("gpu08", 23456)
    text = cluster.explain()
    assert "first host of SLURM_STEP_NODELIST=gpu[08-09]" in text
    assert "port 23456 = 20000 + SLURM_JOB_ID (123456) % 10000" in text


def test_slurm_job_nodelist_and_explicit_ports():
    env = {**SLURM, "STRATAGEM_MASTER_PORT": "4000", "MASTER_PORT": "5000"}
    del env["SLURM_STEP_NODELIST"]
    cluster = resolve_cluster(env=env)
    assert (cluster.master_addr, cluster.master_port) == ("gpu07", 4000)
    del env["STRATAGEM_MASTER_PORT"]
    assert slurm_master_port(env) == (5000, "MASTER_PORT=5000")
    assert resolve_cluster(env={**env, "MASTER_ADDR": "head"}).master_addr == "head"


def test_slurm_tasks_per_node_is_derived_from_the_compressed_form():
    env = {
        **SLURM,
        "SLURM_TASKS_PER_NODE": "4(x1),3(x2)",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "10",
        "SLURM_LOCALID": "2",
    }
    del env["SLURM_NTASKS_PER_NODE"]
    cluster = resolve_cluster(env=env)
    assert cluster.local_world_size == 3
    assert "SLURM_TASKS_PER_NODE=4(x1),3(x2) on node 2" in cluster.explain()


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            _without(SLURM, "SLURM_LOCALID"),
            r"SLURM's variables are only partly set: SLURM_LOCALID missing\. "
            r"Received: SLURM_PROCID='5'\. Start the tasks with srun",
        ),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID must be smaller than SLURM_NTASKS\. Received: SLURM_PROCID=8"),
        ({**SLURM, "SLURM_LOCALID": "4"}, r"SLURM_LOCALID must be smaller than the tasks on this node"),
        (_without(SLURM, "SLURM_NTASKS_PER_NODE"), r"Cannot tell how many tasks run on this node\. Received: neither"),
        (
            {**_without(SLURM, "SLURM_NTASKS_PER_NODE"), "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "2"},
            r"SLURM_NODEID is beyond SLURM_TASKS_PER_NODE\. Received: SLURM_NODEID=2, SLURM_TASKS_PER_NODE='4\(x2\)'",
        ),
        (
            {**_without(SLURM, "SLURM_NTASKS_PER_NODE"), "SLURM_TASKS_PER_NODE": "4x2", "SLURM_NODEID": "0"},
            r"SLURM_TASKS_PER_NODE has a bad entry '4x2'",
        ),
        (_without(SLURM, "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"), r"Cannot find the master host under SLURM"),
        (
            _without(SLURM, "SLURM_JOB_ID"),
            r"Cannot choose a rendezvous port under SLURM: SLURM_JOB_ID is not set\. "
            r"Received: SLURM_PROCID='5'\. Set STRATAGEM_MASTER_PORT",
        ),
        (
            {**SLURM, "STRATAGEM_MASTER_PORT": "0"},
            r"STRATAGEM_MASTER_PORT is not a valid port\. Received: STRATAGEM_MASTER_PORT=0",
        ),
        (
            {**SLURM, "SLURM_STEP_NODELIST": "gpu[09-08]"},
            r"has a descending range \[09-08\]\. Received: 'gpu\[09-08\]'",
        ),
    ],
)
def test_slurm_errors(env, message):
    with pytest.raises(ClusterError, match=message):
        resolve_cluster(env=env)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
        (" c[5] ", ["c5"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("", r"SLURM host list is empty\. Received: ''"),
        ("node[1-2", r"has a '\[' without '\]'\. Received: 'node\[1-2'\. Balance the brackets"),
        ("node1-2]", r"has a '\]' without '\['"),
        ("n[1-[2]]", r"has nested brackets"),
        ("a,,b", r"has an empty entry\. Received: 'a,,b'\. Remove the stray comma"),
        ("n[]", r"has a bad range \[\]"),
        ("n[1-x]", r"has a bad range \[1-x\]"),
        ("n[5-3]", r"has a descending range \[5-3\]\. Received: 'n\[5-3\]'\. Write it as \[3-5\]"),
    ],
)
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(ClusterError, match=message):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]


@pytest.mark.parametrize("module", ["spec", "tf_config", "nodelist", "resolve", "processes", "launch", "mesh"])
def test_docstring_examples_run(module):
    failures, _ = doctest.testmod(importlib.import_module(f"stratagem.cluster.{module}"))
    assert failures == 0
