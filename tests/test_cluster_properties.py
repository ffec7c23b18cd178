"""Property-based tests of the TF_CONFIG parser and the SLURM host-list parser."""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.cluster import expand_nodelist, parse_tf_config
from stratagem.errors import ClusterError

HOSTS = ["h0", "h1", "10.0.0.7", "[::1]", "node-3.example.org"]


@st.composite
def cluster_specs(draw) -> dict[str, list[str]]:
    """A valid ``cluster`` section: at most one chief and one evaluator, at least one chief or worker."""
    counts = {
        "chief": draw(st.integers(0, 1)),
        "worker": draw(st.integers(0, 5)),
        "ps": draw(st.integers(0, 3)),
        "evaluator": draw(st.integers(0, 1)),
    }
    if counts["chief"] + counts["worker"] == 0:
        counts["worker"] = 1
    total = sum(counts.values())
    ports = draw(st.lists(st.integers(1, 65535), min_size=total, max_size=total, unique=True))
    spec, used = {}, 0
    kinds = draw(st.permutations(list(counts)))  # key order of the JSON must not matter
    for kind in kinds:
        if counts[kind] or draw(st.booleans()):  # an empty list is allowed too
            spec[kind] = [f"{draw(st.sampled_from(HOSTS))}:{ports[used + i]}" for i in range(counts[kind])]
        used += counts[kind]
    return spec


@st.composite
def tf_configs(draw) -> dict:
    spec = draw(cluster_specs())
    tasks = [(kind, index) for kind, addrs in spec.items() for index in range(len(addrs))]
    kind, index = draw(st.sampled_from(tasks))
    config = {"cluster": spec, "task": {"type": kind, "index": index}}
    if draw(st.booleans()):
        config["rpc_layer"] = draw(st.sampled_from(["grpc", "grpc+loas"]))
    return config


def every_task(config: dict) -> list:
    return [parse_tf_config({**config, "task": {"type": kind, "index": index}})
            for kind, addrs in config["cluster"].items() for index in range(len(addrs))]


@settings(max_examples=150, deadline=None)
@given(tf_configs())
def test_ranks_are_a_permutation_with_the_chief_at_zero(config):
    clusters = every_task(config)
    members = [c for c in clusters if c.task_type in ("chief", "worker")]
    world_size = len(members)
    assert {c.world_size for c in clusters} == {world_size}
    assert sorted(c.rank for c in members) == list(range(world_size))
    assert all(c.rank is None and c.local_rank is None for c in clusters if c.task_type in ("ps", "evaluator"))
    chief = next(c for c in members if c.rank == 0)
    expected_chief = "chief:0" if config["cluster"].get("chief") else "worker:0"
    assert chief.task_name == expected_chief and chief.is_chief
    assert {c.chief_address for c in clusters} == {config["cluster"][expected_chief.split(":")[0]][0]}
    assert all(c.task_for_rank(c.rank) == c.task_name for c in members)
    # Local ranks number the collective tasks of each host from 0.
    by_host: dict[str, list[int]] = {}
    for c in members:
        by_host.setdefault(c.addresses[c.task_type][c.task_index].rpartition(":")[0], []).append(c.local_rank)
    for c in members:
        local = by_host[c.addresses[c.task_type][c.task_index].rpartition(":")[0]]
        assert sorted(local) == list(range(c.local_world_size))


@settings(max_examples=150, deadline=None)
@given(tf_configs())
def test_round_trip_through_to_tf_config(config):
    cluster = parse_tf_config(json.dumps(config))
    assert cluster.to_tf_config() == config
    assert parse_tf_config(json.dumps(cluster.to_tf_config())) == cluster


def _break(config: dict, how: str, data) -> dict:
    """Apply one mutation that makes a valid TF_CONFIG invalid."""
    broken = copy.deepcopy(config)
    spec, task = broken["cluster"], broken["task"]
    kinds = [k for k, addrs in spec.items() if addrs]
    if how == "drop_cluster":
        del broken["cluster"]
    elif how == "drop_task":
        del broken["task"]
    elif how == "index_out_of_range":
        task["index"] = len(spec[task["type"]]) + data.draw(st.integers(0, 3))
    elif how == "negative_index":
        task["index"] = data.draw(st.integers(-5, -1))
    elif how == "index_not_int":
        task["index"] = data.draw(st.one_of(st.text(max_size=3), st.floats(), st.none(), st.booleans()))
    elif how == "unknown_task_type":
        task["type"] = data.draw(st.text(max_size=8).filter(lambda t: t not in ("chief", "worker", "ps", "evaluator")))
    elif how == "unknown_cluster_type":
        spec[data.draw(st.sampled_from(["master", "workers", "Worker", ""]))] = ["x:1"]
    elif how == "two_chiefs":
        spec["chief"] = ["c1:1", "c2:1"]
    elif how == "two_evaluators":
        spec["evaluator"] = ["e1:1", "e2:1"]
    elif how == "evaluator_task_without_evaluator":
        spec.pop("evaluator", None)
        broken["task"] = {"type": "evaluator", "index": 0}
    elif how == "missing_port":
        kind = data.draw(st.sampled_from(kinds))
        i = data.draw(st.integers(0, len(spec[kind]) - 1))
        spec[kind][i] = spec[kind][i].rpartition(":")[0]
    elif how == "bad_port":
        kind = data.draw(st.sampled_from(kinds))
        i = data.draw(st.integers(0, len(spec[kind]) - 1))
        port = data.draw(st.sampled_from(["0", "65536", "-1", "http", "", "22a"]))
        spec[kind][i] = spec[kind][i].rpartition(":")[0] + ":" + port
    elif how == "non_list_addresses":
        kind = data.draw(st.sampled_from(kinds))
        spec[kind] = data.draw(st.one_of(st.just(",".join(spec[kind])), st.dictionaries(st.text(max_size=2), st.text(max_size=2)), st.integers()))
    elif how == "non_string_address":
        kind = data.draw(st.sampled_from(kinds))
        spec[kind][0] = data.draw(st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=2), max_size=2)))
    elif how == "duplicate_address":
        kind = data.draw(st.sampled_from(kinds))
        spec.setdefault("ps", []).append(spec[kind][0])
    elif how == "unknown_top_level_key":
        broken[data.draw(st.text(max_size=6).filter(lambda k: k not in ("cluster", "task", "rpc_layer", "environment")))] = 1
    elif how == "no_collective_task":
        broken["cluster"] = {"ps": ["p:1"]}
        broken["task"] = {"type": "ps", "index": 0}
    elif how == "rpc_layer_not_string":
        broken["rpc_layer"] = data.draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=1)))
    return broken


MUTATIONS = ["drop_cluster", "drop_task", "index_out_of_range", "negative_index", "index_not_int",
             "unknown_task_type", "unknown_cluster_type", "two_chiefs", "two_evaluators",
             "evaluator_task_without_evaluator", "missing_port", "bad_port", "non_list_addresses",
             "non_string_address", "duplicate_address", "unknown_top_level_key", "no_collective_task",
             "rpc_layer_not_string"]


@settings(max_examples=150, deadline=None)
@given(tf_configs(), st.sampled_from(MUTATIONS), st.data())
def test_every_malformed_config_is_a_cluster_error(config, how, data):
    broken = _break(config, how, data)
    try:
        parse_tf_config(json.dumps(broken))
    except ClusterError as exc:
        assert "Received:" in str(exc) and "Fix:" in str(exc)
    else:
        raise AssertionError(f"{how} was accepted: {broken}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=40), json_values.map(json.dumps)))
def test_arbitrary_input_raises_only_cluster_errors(text):
    try:
        parse_tf_config(text)
    except ClusterError:
        pass


@settings(max_examples=100, deadline=None)
@given(tf_configs(), st.sampled_from(["cluster", "task", "index", "type", "address"]), json_values)
def test_junk_anywhere_raises_only_cluster_errors(config, where, junk):
    broken = copy.deepcopy(config)
    if where in ("cluster", "task"):
        broken[where] = junk
    elif where in ("index", "type"):
        broken["task"][where] = junk
    else:
        kind = next(k for k, v in broken["cluster"].items() if v)
        broken["cluster"][kind][0] = junk
    try:
        parse_tf_config(broken)
    except ClusterError:
        pass


# -- SLURM host lists ------------------------------------------------------------------------

@st.composite
def host_groups(draw) -> tuple[str, list[str]]:
    """A bracketed host pattern and the hosts it names, built independently of the parser."""
    prefix = draw(st.from_regex(r"[a-z][a-z0-9\-]{0,5}", fullmatch=True))
    width = draw(st.integers(1, 3))
    numbers = sorted(draw(st.sets(st.integers(0, 10**width - 1), min_size=1, max_size=6)))
    parts, hosts = [], []
    for n in numbers:
        parts.append(str(n).zfill(width))
        hosts.append(f"{prefix}{str(n).zfill(width)}")
    return f"{prefix}[{','.join(parts)}]", hosts


@settings(max_examples=150, deadline=None)
@given(st.lists(host_groups(), min_size=1, max_size=4))
def test_nodelist_expands_every_listed_host_in_order(groups):
    nodelist = ",".join(pattern for pattern, _ in groups)
    expected = [host for _, hosts in groups for host in hosts]
    assert expand_nodelist(nodelist) == expected


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="ab01-9[],", max_size=20))
def test_nodelist_raises_only_cluster_errors(text):
    try:
        hosts = expand_nodelist(text)
    except ClusterError:
        return
    assert hosts and all("[" not in h and "]" not in h and "," not in h for h in hosts)
