"""TF_CONFIG parsing: hand-worked ranks, and one test per error path."""

from __future__ import annotations

import json

import pytest

from stratagem.cluster import Cluster, parse_tf_config, split_address
from stratagem.errors import ClusterError, InputError

FULL = {
    "cluster": {
        "chief": ["host0:2222"],
        "worker": ["host1:2222", "host1:2223", "host2:2222"],
        "ps": ["host3:2222", "host3:2223"],
        "evaluator": ["host4:2222"],
    },
    "rpc_layer": "grpc",
}


def with_task(kind: str, index: int, base: dict = FULL) -> dict:
    return {**base, "task": {"type": kind, "index": index}}


# (task type, index) -> (rank, local_rank, local_world_size), worked out by hand from FULL:
# the chief is rank 0, worker i is rank i + 1; host1 runs worker:0 and worker:1.
EXPECTED = {
    ("chief", 0): (0, 0, 1),
    ("worker", 0): (1, 0, 2),
    ("worker", 1): (2, 1, 2),
    ("worker", 2): (3, 0, 1),
    ("ps", 0): (None, None, 0),
    ("ps", 1): (None, None, 0),
    ("evaluator", 0): (None, None, 0),
}


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_ranks_with_a_chief(task):
    cluster = parse_tf_config(with_task(*task))
    rank, local_rank, local_world_size = EXPECTED[task]
    assert (cluster.rank, cluster.local_rank, cluster.local_world_size) == (rank, local_rank, local_world_size)
    assert cluster.world_size == 4 and cluster.num_workers == 4
    assert cluster.is_chief == (task == ("chief", 0))
    assert cluster.chief_address == "host0:2222"
    assert (cluster.master_addr, cluster.master_port) == ("host0", 2222)
    assert cluster.rpc_layer == "grpc"
    assert cluster.source == "TF_CONFIG"
    assert cluster.task_name == f"{task[0]}:{task[1]}"


def test_without_a_chief_worker_zero_is_rank_zero():
    config = {"cluster": {"worker": ["a:1", "b:2", "c:3"], "ps": ["d:4"]}, "task": {"type": "worker", "index": 2}}
    cluster = parse_tf_config(json.dumps(config))
    assert (cluster.rank, cluster.world_size, cluster.chief_address) == (2, 3, "a:1")
    assert parse_tf_config({**config, "task": {"type": "worker", "index": 0}}).is_chief
    assert [cluster.task_for_rank(r) for r in range(3)] == ["worker:0", "worker:1", "worker:2"]


def test_task_for_rank_with_a_chief():
    cluster = parse_tf_config(with_task("ps", 1))
    assert [cluster.task_for_rank(r) for r in range(4)] == ["chief:0", "worker:0", "worker:1", "worker:2"]
    with pytest.raises(ClusterError, match=r"Rank out of range. Received: rank=4, world_size=4"):
        cluster.task_for_rank(4)


def test_ipv6_addresses_are_bracketed():
    cluster = parse_tf_config({"cluster": {"worker": ["[::1]:7000"]}, "task": {"type": "worker", "index": 0}})
    assert (cluster.master_addr, cluster.master_port) == ("::1", 7000)
    assert split_address("[fe80::1]:80") == ("fe80::1", 80)


def test_round_trip_and_renderings():
    config = with_task("worker", 1)
    cluster = parse_tf_config(config)
    assert cluster.to_tf_config() == config
    assert Cluster.from_tf_config(json.dumps(config), source="TF_CONFIG") == cluster
    data = json.loads(cluster.to_json())
    assert data["rank"] == 2 and data["task"] == "worker:1" and data["source"] == "TF_CONFIG"
    text = cluster.explain()
    assert "cluster from TF_CONFIG: task worker:1, rank 2 of 4" in text
    assert "TF_CONFIG names task worker:1 at host1:2223" in text
    assert "not in the collective world" in parse_tf_config(with_task("ps", 0)).explain()


def test_environment_key_is_accepted():
    cluster = parse_tf_config(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "environment": "cloud"}
    )
    assert cluster.world_size == 1


GOOD = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}

# (config, regex the message must match): every error quotes the offending part and a fix.
MALFORMED = [
    (
        '{"cluster": ',
        r"TF_CONFIG is not valid JSON \(Expecting value at line 1 column 13\)\. "
        r"Received: '\{\"cluster\": '\. Write it as JSON",
    ),
    ("[1, 2]", r"TF_CONFIG is not a JSON object\. Received: \[1, 2\]\."),
    ({**GOOD, "job": {}}, r"TF_CONFIG has unknown key\(s\) \['job'\]\. .*Use only \['cluster', 'task'"),
    ({"task": GOOD["task"]}, r"TF_CONFIG has no 'cluster'\..*or unset TF_CONFIG"),
    ({}, r"TF_CONFIG has no 'cluster'\. Received: \{\}\."),
    ({**GOOD, "cluster": {}}, r"'cluster' must be a non-empty object of address lists\. Received: cluster=\{\}"),
    ({**GOOD, "cluster": ["a:1"]}, r"'cluster' must be a non-empty object.*Received: cluster=\['a:1'\]"),
    (
        {"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}},
        r"unknown task type in 'cluster' \('master' is TensorFlow 1's name for the chief: rename it 'chief'\)\. "
        r"Received: 'master'",
    ),
    (
        {"cluster": {"workers": ["a:1"]}, "task": GOOD["task"]},
        r"unknown task type in 'cluster'\. Received: 'workers'\. Use only \['chief', 'worker', 'ps', 'evaluator'\]",
    ),
    (
        {**GOOD, "cluster": {"worker": "a:1"}},
        r"cluster\['worker'\] is not a list of addresses\. Received: worker='a:1'",
    ),
    ({**GOOD, "cluster": {"worker": ["a:1", 7]}}, r"cluster\['worker'\]\[1\] is not a string\. Received: 7"),
    (
        {**GOOD, "cluster": {"worker": ["a"]}},
        r"cluster\['worker'\]\[0\] has no port\. Received: 'a'\. "
        r"Write it as \"host:port\", e.g\. \"a:2222\"",
    ),
    ({**GOOD, "cluster": {"worker": [":80"]}}, r"cluster\['worker'\]\[0\] has no port\. Received: ':80'"),
    (
        {**GOOD, "cluster": {"worker": ["a:http"]}},
        r"has an invalid port\. Received: 'a:http'\. Use a port number in 1\.\.65535",
    ),
    ({**GOOD, "cluster": {"worker": ["a:70000"]}}, r"has an invalid port\. Received: 'a:70000'"),
    (
        {**GOOD, "cluster": {"worker": ["::1:80"]}},
        r"is an IPv6 address without brackets\. Received: '::1:80'\. "
        r"Write it as \"\[addr\]:port\"",
    ),
    (
        {**GOOD, "cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}},
        r"TF_CONFIG lists more than one chief\. Received: chief=\['a:1', 'b:1'\]\. Keep one chief",
    ),
    (
        {"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}, "task": GOOD["task"]},
        r"TF_CONFIG lists more than one evaluator\. Received: evaluator=\['e:1', 'f:1'\]",
    ),
    (
        {"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}},
        r"has no chief and no worker.*Received: cluster=\{'ps': \['a:1'\]\}.*worker 0 acts as chief",
    ),
    (
        {**GOOD, "cluster": {"worker": ["a:1", "a:1"]}},
        r"gives two tasks the same address\. Received: worker:0 and worker:1 at 'a:1'",
    ),
    ({"cluster": GOOD["cluster"]}, r"TF_CONFIG has no 'task'\..*\"task\": \{\"type\": \"worker\", \"index\": 0\}"),
    ({**GOOD, "task": "worker"}, r"'task' must be an object with 'type' and 'index'\. Received: task='worker'"),
    (
        {**GOOD, "task": {"type": "worker"}},
        r"'task' must have exactly 'type' and 'index'\. Received: task=\{'type': 'worker'\}",
    ),
    ({**GOOD, "task": {"type": "worker", "index": 0, "trial": 1}}, r"must have exactly 'type' and 'index'"),
    ({**GOOD, "task": {"type": "boss", "index": 0}}, r"unknown task type in 'task'\. Received: type='boss'"),
    (
        {**GOOD, "task": {"type": "evaluator", "index": 0}},
        r"names task type 'evaluator', which 'cluster' does not list\. .*Add \"evaluator\": \[\"host:port\"\]",
    ),
    ({**GOOD, "task": {"type": "ps", "index": 0}}, r"names task type 'ps', which 'cluster' does not list"),
    ({**GOOD, "task": {"type": "worker", "index": "0"}}, r"'task\.index' is not an integer\. Received: index='0'"),
    ({**GOOD, "task": {"type": "worker", "index": True}}, r"'task\.index' is not an integer\. Received: index=True"),
    (
        {**GOOD, "task": {"type": "worker", "index": 2}},
        r"'task\.index' is out of range for 2 worker task\(s\)\. Received: task=worker:2\. Use an index in 0\.\.1",
    ),
    (
        {**GOOD, "task": {"type": "worker", "index": -1}},
        r"out of range for 2 worker task\(s\)\. Received: task=worker:-1",
    ),
    ({**GOOD, "rpc_layer": 5}, r"'rpc_layer' is not a string\. Received: rpc_layer=5"),
]


@pytest.mark.parametrize(("config", "message"), MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_tf_config(config, message):
    with pytest.raises(ClusterError, match=message):
        parse_tf_config(config)


def test_a_malformed_cluster_is_a_bad_argument_like_any_other():
    # ClusterError is an InputError, so `except sg.InputError` catches every bad argument, cluster included.
    with pytest.raises(InputError, match=r"TF_CONFIG is not a JSON object\. Received: \[1, 2\]\."):
        parse_tf_config("[1, 2]")


def test_to_tf_config_needs_addresses():
    cluster = Cluster(
        task_type="worker",
        task_index=1,
        rank=1,
        world_size=2,
        local_rank=1,
        local_world_size=2,
        chief_address="h:1",
        master_addr="h",
        master_port=1,
        source="torchrun",
    )
    with pytest.raises(ClusterError, match=r"has no per-task addresses.*Received: a cluster from torchrun \(worker:1"):
        cluster.to_tf_config()


def _cluster(**changes) -> Cluster:
    fields = dict(
        task_type="worker",
        task_index=0,
        rank=0,
        world_size=2,
        local_rank=0,
        local_world_size=1,
        chief_address="h:1",
        master_addr="h",
        master_port=1,
        source="explicit",
    )
    return Cluster(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"source": "mpi"}, r"Unknown cluster source\. Received: source='mpi'\. Use one of"),
        ({"task_type": "boss"}, r"Unknown task type\. Received: task_type='boss'"),
        ({"addresses": {"workers": ["h:1"]}}, r"Unknown task type in addresses\. Received: \['workers'\]"),
        ({"rank": 2}, r"rank must be in 0\.\.world_size-1\. Received: rank=2, world_size=2"),
        ({"world_size": 0}, r"rank must be in 0\.\.world_size-1\. Received: rank=0, world_size=0"),
        ({"task_type": "ps"}, r"Only the chief and workers have a rank\. Received: task_type='ps', rank=0"),
        ({"rank": None}, r"Only the chief and workers have a rank\. Received: task_type='worker', rank=None"),
        (
            {"local_rank": 1},
            r"local_rank must be in 0\.\.local_world_size-1\. Received: local_rank=1, local_world_size=1",
        ),
        ({"master_port": 70000}, r"master_port is not a port\. Received: master_port=70000"),
    ],
)
def test_constructed_cluster_is_validated(changes, message):
    assert _cluster().rank == 0
    with pytest.raises(ClusterError, match=message):
        _cluster(**changes)
