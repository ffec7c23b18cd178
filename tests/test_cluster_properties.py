"""Property-based tests of every cluster resolver: TF_CONFIG, torchrun's and SLURM's variables, SLURM host
lists, and the Cluster value itself. Whatever the input, each gives a Cluster or a ClusterError that names the
variable and a short form of the value, in bounded time (the deadline) and memory (tracemalloc)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stratagem
from stratagem.cluster import Cluster, expand_nodelist, expand_tasks_per_node, parse_tf_config, resolve_cluster
from stratagem.cluster.nodelist import MAX_HOSTS, first_host, tasks_on_node
from stratagem.errors import ClusterError

# Every example runs in microseconds; the deadline is what an unbounded expansion would blow through.
DEADLINE_MS = 2000
# The longest error message any input may produce: the value is cut, never quoted whole.
MAX_MESSAGE = 1500

# The project's error dialect: "What is wrong. Received: VALUE. What to do.", the advice a sentence of its own.
ADVICE_AFTER_RECEIVED = re.compile(r"Received: .*\. [A-Z]", re.DOTALL)


def _says_what_to_do(message: str) -> bool:
    return ADVICE_AFTER_RECEIVED.search(message) is not None and "Fix:" not in message


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
    return [
        parse_tf_config({**config, "task": {"type": kind, "index": index}})
        for kind, addrs in config["cluster"].items()
        for index in range(len(addrs))
    ]


@settings(max_examples=150, deadline=DEADLINE_MS)
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


@settings(max_examples=150, deadline=DEADLINE_MS)
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
        spec[kind] = data.draw(
            st.one_of(
                st.just(",".join(spec[kind])), st.dictionaries(st.text(max_size=2), st.text(max_size=2)), st.integers()
            )
        )
    elif how == "non_string_address":
        kind = data.draw(st.sampled_from(kinds))
        spec[kind][0] = data.draw(st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=2), max_size=2)))
    elif how == "duplicate_address":
        kind = data.draw(st.sampled_from(kinds))
        spec.setdefault("ps", []).append(spec[kind][0])
    elif how == "unknown_top_level_key":
        broken[
            data.draw(st.text(max_size=6).filter(lambda k: k not in ("cluster", "task", "rpc_layer", "environment")))
        ] = 1
    elif how == "no_collective_task":
        broken["cluster"] = {"ps": ["p:1"]}
        broken["task"] = {"type": "ps", "index": 0}
    elif how == "rpc_layer_not_string":
        broken["rpc_layer"] = data.draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=1)))
    return broken


MUTATIONS = [
    "drop_cluster",
    "drop_task",
    "index_out_of_range",
    "negative_index",
    "index_not_int",
    "unknown_task_type",
    "unknown_cluster_type",
    "two_chiefs",
    "two_evaluators",
    "evaluator_task_without_evaluator",
    "missing_port",
    "bad_port",
    "non_list_addresses",
    "non_string_address",
    "duplicate_address",
    "unknown_top_level_key",
    "no_collective_task",
    "rpc_layer_not_string",
]


@settings(max_examples=150, deadline=DEADLINE_MS)
@given(tf_configs(), st.sampled_from(MUTATIONS), st.data())
def test_every_malformed_config_is_a_cluster_error(config, how, data):
    broken = _break(config, how, data)
    try:
        parse_tf_config(json.dumps(broken))
    except ClusterError as exc:
        assert _says_what_to_do(str(exc)), str(exc)
    else:
        raise AssertionError(f"{how} was accepted: {broken}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=DEADLINE_MS)
@given(st.one_of(st.text(max_size=40), json_values.map(json.dumps)))
def test_arbitrary_input_raises_only_cluster_errors(text):
    try:
        parse_tf_config(text)
    except ClusterError:
        pass


@settings(max_examples=100, deadline=DEADLINE_MS)
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


@settings(max_examples=150, deadline=DEADLINE_MS)
@given(st.lists(host_groups(), min_size=1, max_size=4))
def test_nodelist_expands_every_listed_host_in_order(groups):
    nodelist = ",".join(pattern for pattern, _ in groups)
    expected = [host for _, hosts in groups for host in hosts]
    assert expand_nodelist(nodelist) == expected


@settings(max_examples=150, deadline=DEADLINE_MS)
@given(st.text(alphabet="ab01-9[],", max_size=20))
def test_nodelist_raises_only_cluster_errors(text):
    try:
        hosts = expand_nodelist(text)
    except ClusterError:
        return
    assert hosts and all("[" not in h and "]" not in h and "," not in h for h in hosts)


# -- bounded in time and memory, whatever the input ------------------------------------------------


def bounded(call, *args, max_bytes: int = 1 << 20):
    """Runs ``call(*args)``; returns its result or its ClusterError, checking the Python memory it took."""
    tracemalloc.start()
    try:
        result = call(*args)
    except ClusterError as error:
        result = error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < max_bytes, f"{call.__name__} took {peak} bytes"
    if isinstance(result, ClusterError):
        message = str(result)
        assert _says_what_to_do(message) and len(message) < MAX_MESSAGE, message
    return result


# Numbers that str.isdigit accepts but int() refuses or takes long over, and other junk.
BAD_NUMBERS = st.one_of(
    st.sampled_from(["\u00b2", "1\u00b3", "", " ", "-1", "+1", "1.0", "1e3", "0x10", "one", "\u0663\u00b2"]),
    st.integers(19, 6000).map(lambda n: "1" * n),  # more digits than any rank, up to past int()'s 4300
    st.text(max_size=30).filter(lambda t: not t.strip().isascii() or not t.strip().isdigit()),
)
BIG = 10**18 - 1


@st.composite
def torchrun_envs(draw) -> tuple[dict[str, str], set[str]]:
    """torchrun's variables, each valid or junk; returns the environment and the names given junk."""
    world_size = draw(st.integers(1, BIG))
    rank = draw(st.integers(0, world_size - 1))
    local_world_size = draw(st.integers(1, min(world_size, BIG)))
    local_rank = draw(st.integers(0, local_world_size - 1))
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": draw(st.sampled_from(HOSTS[:3])),
        "MASTER_PORT": str(draw(st.integers(1, 65535))),
    }
    broken = set(draw(st.sets(st.sampled_from(sorted(env)), max_size=3)))
    for name in broken:
        env[name] = draw(
            st.sampled_from(["", " ", "a b", "h\x00", "x" * 300]) if name == "MASTER_ADDR" else BAD_NUMBERS
        )
    return env, broken


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(torchrun_envs())
def test_torchrun_variables_give_a_cluster_or_an_error_naming_the_bad_one(drawn):
    env, broken = drawn
    result = bounded(lambda: resolve_cluster(env=env))
    if not broken:
        assert isinstance(result, Cluster), result
        assert (result.rank, result.world_size, result.local_rank) == (
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env["LOCAL_RANK"]),
        )
    else:
        assert isinstance(result, ClusterError), f"{broken} accepted: {env}"
        assert any(f"{name}=" in str(result) or f"{name} " in str(result) for name in broken), str(result)


@st.composite
def hostile_nodelists(draw) -> tuple[str, str]:
    """A host list with numbers of up to 18 digits and ranges of up to a million hosts, and its first host
    worked out by hand. (Wider ranges run in the capped process of the last test: expanded in this one,
    they would take the test runner's memory, not just fail.)"""
    prefix = draw(st.from_regex(r"[a-z][a-z0-9\-]{0,5}", fullmatch=True))
    width = draw(st.integers(1, 18))
    low = draw(st.integers(0, 10**width - 1))
    high = draw(st.integers(low, min(low + 10**6, 10**18 - 1)))
    suffix = draw(st.sampled_from(["", "-ib", "[1-9]"]))
    rest = draw(st.sampled_from(["", ",gpu[1-999999]", ",login1"]))
    first = f"{prefix}{str(low).zfill(width)}{'1' if suffix == '[1-9]' else suffix}"
    return f"{prefix}[{str(low).zfill(width)}-{high}]{suffix}{rest}", first


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(hostile_nodelists(), st.integers(1, 8))
def test_slurm_takes_the_first_host_of_any_node_list_without_expanding_it(drawn, tasks):
    nodelist, first = drawn
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": str(tasks),
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "77",
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": f"{tasks}(x{10**17})",
        "SLURM_STEP_NODELIST": nodelist,
    }
    cluster = bounded(lambda: resolve_cluster(env=env))
    assert isinstance(cluster, Cluster), cluster
    assert (cluster.master_addr, cluster.local_world_size) == (first, tasks)
    assert bounded(first_host, nodelist) == first


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(st.lists(host_groups(), min_size=1, max_size=4))
def test_first_host_is_the_first_of_the_expansion(groups):
    nodelist = ",".join(pattern for pattern, _ in groups)
    assert first_host(nodelist) == expand_nodelist(nodelist)[0] == groups[0][1][0]


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(st.text(alphabet="ab01-9[],\u00b2\u0663 x", max_size=40))
def test_a_malformed_node_list_is_refused_by_first_host_and_expansion_alike(text):
    first = bounded(first_host, text)
    hosts = bounded(expand_nodelist, text, max_bytes=64 << 20)
    if isinstance(first, ClusterError):
        assert isinstance(hosts, ClusterError)  # malformed past the first host too: both refuse
    elif not isinstance(hosts, ClusterError):
        assert hosts[0] == first
    else:
        assert f"names more than {MAX_HOSTS} hosts" in str(hosts)


@st.composite
def tasks_per_node(draw) -> tuple[str, list[tuple[int, int]]]:
    """A SLURM_TASKS_PER_NODE value with repeat counts of any size, and its entries."""
    entries = draw(st.lists(st.tuples(st.integers(1, 10**9 - 1), st.integers(1, 10**18 - 1)), min_size=1, max_size=5))
    return ",".join(f"{t}(x{r})" if r > 1 else str(t) for t, r in entries), entries


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(tasks_per_node(), st.data())
def test_tasks_on_node_reads_any_repeat_count_without_expanding_it(drawn, data):
    value, entries = drawn
    total = sum(r for _, r in entries)
    node = data.draw(st.integers(0, total + 3))
    expected, start = None, 0
    for tasks, repeat in entries:  # the entry whose run of nodes holds `node`
        if start <= node < start + repeat:
            expected = tasks
        start += repeat
    result = bounded(tasks_on_node, value, node)
    assert result == expected if expected is not None else isinstance(result, ClusterError)
    if total > MAX_HOSTS:
        assert isinstance(bounded(expand_tasks_per_node, value), ClusterError)


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(st.one_of(BAD_NUMBERS, st.text(alphabet="0123456789(x),\u00b2", max_size=40)), st.integers(0, 5))
def test_a_malformed_tasks_per_node_value_is_a_cluster_error(value, node):
    result = bounded(tasks_on_node, value, node)
    assert isinstance(result, (int, ClusterError))


# TF_CONFIG texts that break a JSON reader rather than the parser: deep nesting, huge numbers, odd ports.
HOSTILE_TF_CONFIGS = st.one_of(
    st.integers(1, 200_000).map(lambda n: "[" * n),
    st.integers(1, 50_000).map(lambda n: '{"a":' * n),
    st.integers(1, 3000).map(lambda n: '{"cluster": {"worker": ["h:1"]}, "cluster":' + "[" * n + "]" * n + "}"),
    st.integers(4000, 6000).map(
        lambda n: '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1' + "0" * n + "}}"
    ),
    st.sampled_from(["\u00b2", "\u0663", "1" * 5000, "", "65536", "٣٣"]).map(
        lambda port: json.dumps({"cluster": {"worker": [f"h:{port}"]}, "task": {"type": "worker", "index": 0}})
    ),
)


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(HOSTILE_TF_CONFIGS)
def test_hostile_tf_configs_are_cluster_errors(text):
    result = bounded(parse_tf_config, text, max_bytes=64 << 20)  # json.loads itself holds what it read
    assert isinstance(result, ClusterError), result
    assert bounded(lambda: resolve_cluster(env={"TF_CONFIG": text}), max_bytes=64 << 20).args == result.args


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=25, deadline=DEADLINE_MS)
@given(st.integers(1, 100_000), st.sampled_from(["cluster", "task", "index", "address", "rpc_layer"]))
def test_deeply_nested_explicit_configs_are_cluster_errors(depth, where):
    config = {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}
    junk = _nested(depth)
    if where in ("cluster", "task", "rpc_layer"):
        config[where] = junk
    elif where == "index":
        config["task"]["index"] = junk
    else:
        config["cluster"]["worker"][0] = junk
    assert isinstance(bounded(parse_tf_config, config, max_bytes=64 << 20), ClusterError)


# Values for Cluster's fields: right types, wrong types, huge ints, deep nesting.
FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70000),
    st.sampled_from([2**63, -(2**63), 10**5000]),
    st.sampled_from(["worker", "chief", "ps", "evaluator", "explicit", "torchrun", "h:1", "", "x" * 1000]),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.sampled_from(["worker", "ps", "x"]), st.lists(st.sampled_from(["h:1", "h:2"]), max_size=2)),
    st.just(_nested(5000)),
)
CLUSTER_FIELDS = (
    "task_type",
    "task_index",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "addresses",
    "chief_address",
    "master_addr",
    "master_port",
    "rpc_layer",
    "source",
    "evidence",
)


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(st.fixed_dictionaries({}, optional={name: FIELD_VALUES for name in CLUSTER_FIELDS}))
def test_a_cluster_of_any_field_values_is_built_or_refused_with_a_cluster_error(changes):
    fields = {
        "task_type": "worker",
        "task_index": 0,
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "chief_address": "h:1",
        "master_addr": "h",
        "master_port": 1,
        "source": "explicit",
        **changes,
    }
    result = bounded(lambda: Cluster(**fields))
    if isinstance(result, Cluster):  # every rendering works on what was accepted
        assert result.explain() and json.loads(result.to_json())["world_size"] == result.world_size


# The inputs of the reports, each in a process whose address space is capped at 256 MiB above what its
# imports took: before the bounds, they raised ValueError, RecursionError or MemoryError, or grew past 1 GiB.
# The resolvers import nothing but each other and stratagem.errors; the script loads them without the
# package's __init__ (which imports torch), so the process starts in a fraction of a second.
HOSTILE_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys, time, types
    for name, folder in (("stratagem", sys.argv[1]), ("stratagem.cluster", os.path.join(sys.argv[1], "cluster"))):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    from stratagem.cluster.resolve import resolve_cluster
    from stratagem.cluster.tf_config import parse_tf_config
    from stratagem.errors import ClusterError

    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h",
                "MASTER_PORT": "29500"}
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5", "SLURM_NODEID": "0"}
    cases = {
        "RANK=²": lambda: resolve_cluster(env={**torchrun, "RANK": "\u00b2"}),
        "RANK of 5000 digits": lambda: resolve_cluster(env={**torchrun, "RANK": "1" * 5000}),
        "TF_CONFIG=[ * 100000": lambda: parse_tf_config("[" * 100000),
        "SLURM_TASKS_PER_NODE=2(x10000000000)": lambda: resolve_cluster(env={
            **slurm, "SLURM_TASKS_PER_NODE": "2(x10000000000)", "SLURM_STEP_NODELIST": "n1"}).local_world_size,
        "SLURM_STEP_NODELIST=n[1-100000000]": lambda: resolve_cluster(env={
            **slurm, "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n[1-100000000]"}).master_addr,
        "SLURM_STEP_NODELIST=r[1-9*18]-n[0-9*18]": lambda: resolve_cluster(env={
            **slurm, "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "r[1-" + "9" * 18 + "]-n[0-" + "9" * 18 + "]"
        }).master_addr,
    }
    report = {}
    for name, case in cases.items():
        start = time.perf_counter()
        try:
            outcome = repr(case())
        except ClusterError as error:
            outcome = "ClusterError: " + str(error)[:120]
        except BaseException as error:
            outcome = type(error).__name__
        report[name] = [outcome, time.perf_counter() - start]
    print(json.dumps(report))
""")


@pytest.mark.timeout(60)
def test_the_reported_hostile_inputs_are_bounded_and_give_cluster_errors():
    package = str(Path(stratagem.__file__).parent)
    result = subprocess.run(
        [sys.executable, "-c", HOSTILE_SCRIPT, package], capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["RANK=²"][0].startswith("ClusterError: RANK is not an integer >= 0. Received: RANK='²'")
    assert report["RANK of 5000 digits"][0].startswith("ClusterError: RANK is not an integer >= 0. Received: RANK='111")
    assert report["TF_CONFIG=[ * 100000"][0].startswith("ClusterError: TF_CONFIG nests arrays or objects too deeply")
    assert report["SLURM_TASKS_PER_NODE=2(x10000000000)"][0] == "2"
    assert report["SLURM_STEP_NODELIST=n[1-100000000]"][0] == "'n1'"
    assert report["SLURM_STEP_NODELIST=r[1-9*18]-n[0-9*18]"][0] == "'r1-n0'"
    assert all(seconds < 1.0 for _, seconds in report.values()), report
