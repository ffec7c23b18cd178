"""Parse a TF_CONFIG into a ``Cluster``.

A TF_CONFIG is JSON of this shape (the format TensorFlow, Kubeflow's TFJob and Vertex AI use)::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"], "evaluator": ["host4:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}

Ranks: the chief is rank 0 (task ``chief``, else worker 0), worker ``i`` is rank
``i + number of chiefs``; ``ps`` and ``evaluator`` tasks have no rank (see ``spec``).
The chief's ``host:port`` is where torch.distributed's TCP store listens.

We are stricter than TensorFlow in two places, because both hide mistakes: every address must
carry a port, and an ``evaluator`` task must be listed in ``cluster`` (one at most).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from typing import Any

from stratagem.cluster.spec import COLLECTIVE_TASK_TYPES, TASK_TYPES, Cluster, show
from stratagem.errors import ClusterError

_TOP_LEVEL_KEYS = ("cluster", "task", "rpc_layer", "environment")
_TASK_KEYS = ("type", "index")
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII digits: str.isdigit also accepts '²', which int() refuses
_EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'


def _fail(what: str, received: str, fix: str) -> ClusterError:
    return ClusterError(f"TF_CONFIG {what}. Received: {received}. {fix}")


def split_address(address: str, *, where: str = "address") -> tuple[str, int]:
    """Split ``host:port`` (or ``[ipv6]:port``) into host and port, or raise ``ClusterError``.

    Example:
        >>> split_address("10.0.0.1:2222")
        ('10.0.0.1', 2222)
    """
    if not isinstance(address, str):
        raise _fail(f"{where} is not a string", _show(address), 'Write each address as "host:port"')
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # An unbracketed IPv6 address: its last group would be read as a port.
        raise _fail(
            f"{where} is an IPv6 address without brackets",
            _show(address),
            'Write it as "[addr]:port", e.g. "[::1]:2222"',
        )
    if not sep or not host or any(c.isspace() for c in address):
        example = address.strip()[:60] if address.strip() and len(address) <= 255 else "host"
        raise _fail(f"{where} has no port", _show(address), f'Write it as "host:port", e.g. "{example}:2222"')
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise _fail(f"{where} has an invalid port", _show(address), "Use a port number in 1..65535")
    return host, int(port_text)


_MAX_DEPTH = 64
"""A TF_CONFIG nests 4 levels; deeper text is refused before anything recurses over it (an error message shows
the value, and `repr` recurses), so the error does not depend on how deep the caller's stack is."""


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests lists or dicts more than `limit` deep; without recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _json_loads(text: str) -> Any:
    """`json.loads(text)` on a thread of its own. json's decoder recurses once per nested array or object, so
    whether deep nesting ends in a RecursionError or in the JSONDecodeError of a malformed text would otherwise
    depend on how deep the caller's stack already is: the same TF_CONFIG gave two different errors, read directly
    and through `resolve_cluster`. A new thread starts at the same depth whoever calls."""
    outcome: list[Any] = []

    def read() -> None:
        try:
            outcome.append((json.loads(text), None))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread below
            outcome.append((None, exc))

    reader = threading.Thread(target=read, name="stratagem-tf-config")
    reader.start()
    reader.join()
    value, error = outcome[0]
    if error is not None:
        raise error
    return value


def _load(config: Mapping[str, Any] | str) -> Mapping[str, Any]:
    if isinstance(config, str):
        try:
            config = _json_loads(config)
        except json.JSONDecodeError as exc:
            raise _fail(
                f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                _show(exc.doc),
                f"Write it as JSON, e.g. {_EXAMPLE}",
            ) from None
        except RecursionError:
            raise _fail(
                "nests arrays or objects too deeply to read",
                _show(config),
                f"Write it as a flat object, e.g. {_EXAMPLE}",
            ) from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            raise _fail(
                f"is not JSON that can be read ({str(exc)[:80]})", _show(config), f"Write it as JSON, e.g. {_EXAMPLE}"
            ) from None
        if _deeper_than(config, _MAX_DEPTH):
            raise _fail(
                "nests arrays or objects too deeply to read",
                f"<nested more than {_MAX_DEPTH} levels>",
                f"Write it as a flat object, e.g. {_EXAMPLE}",
            )
    if not isinstance(config, Mapping):
        raise _fail("is not a JSON object", _show(config), f"Write it as an object, e.g. {_EXAMPLE}")
    unknown = [key for key in config if key not in _TOP_LEVEL_KEYS]
    if unknown:
        raise _fail(
            f"has unknown key(s) {_show(unknown, 100)}", _show(dict(config)), f"Use only {list(_TOP_LEVEL_KEYS)}"
        )
    return config


def _show(value: Any, limit: int = 300) -> str:
    """``repr`` of a received value, cut short so a huge TF_CONFIG does not flood the message."""
    return show(value, limit)


def _parse_cluster(cluster: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(cluster, Mapping) or not cluster:
        raise _fail(
            "'cluster' must be a non-empty object of address lists",
            f"cluster={_show(cluster)}",
            'List addresses by task type, e.g. {"worker": ["host1:2222"]}',
        )
    addresses: dict[str, tuple[str, ...]] = {}
    for kind, addrs in cluster.items():
        if kind not in TASK_TYPES:
            hint = " ('master' is TensorFlow 1's name for the chief: rename it 'chief')" if kind == "master" else ""
            raise _fail(f"has an unknown task type in 'cluster'{hint}", _show(kind), f"Use only {list(TASK_TYPES)}")
        if not isinstance(addrs, list):
            raise _fail(
                f"cluster[{kind!r}] is not a list of addresses",
                f"{kind}={_show(addrs)}",
                f'Write it as a list, e.g. "{kind}": ["host:2222"]',
            )
        for position, address in enumerate(addrs):
            split_address(address, where=f"cluster[{kind!r}][{position}]")
        addresses[kind] = tuple(addrs)
    for kind in ("chief", "evaluator"):
        if len(addresses.get(kind, ())) > 1:
            raise _fail(
                f"lists more than one {kind}",
                f"{kind}={_show(list(addresses[kind]))}",
                f"Keep one {kind}; list the other tasks as 'worker'",
            )
    if not addresses.get("chief") and not addresses.get("worker"):
        raise _fail(
            "has no chief and no worker, so no task can run the training loop",
            f"cluster={_show(dict((k, list(v)) for k, v in addresses.items()))}",
            'Add "worker": ["host:port"] (worker 0 acts as chief)',
        )
    seen: dict[str, str] = {}
    for kind, addrs in addresses.items():
        for index, address in enumerate(addrs):
            if address in seen:
                raise _fail(
                    "gives two tasks the same address",
                    f"{seen[address]} and {kind}:{index} at {_show(address)}",
                    "Give each task its own host:port",
                )
            seen[address] = f"{kind}:{index}"
    return addresses


def _parse_task(task: Any, addresses: Mapping[str, tuple[str, ...]]) -> tuple[str, int]:
    if not isinstance(task, Mapping):
        raise _fail(
            "'task' must be an object with 'type' and 'index'",
            f"task={_show(task)}",
            'Add "task": {"type": "worker", "index": 0}',
        )
    unknown = [key for key in task if key not in _TASK_KEYS]
    missing = [key for key in _TASK_KEYS if key not in task]
    if unknown or missing:
        raise _fail(
            "'task' must have exactly 'type' and 'index'",
            f"task={_show(dict(task))}",
            'Write it as "task": {"type": "worker", "index": 0}',
        )
    kind, index = task["type"], task["index"]
    if kind not in TASK_TYPES:
        raise _fail("has an unknown task type in 'task'", f"type={_show(kind)}", f"Use one of {list(TASK_TYPES)}")
    if kind not in addresses:
        # TensorFlow lets an evaluator run outside 'cluster'; we ask for it so every task agrees.
        raise _fail(
            f"names task type {kind!r}, which 'cluster' does not list",
            f"task={_show(dict(task))}, cluster types={list(addresses)}",
            f'Add "{kind}": ["host:port"] to "cluster", or correct the task type',
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail("'task.index' is not an integer", f"index={_show(index)}", "Write the index as a number, e.g. 0")
    count = len(addresses[kind])
    if not 0 <= index < count:
        raise _fail(
            f"'task.index' is out of range for {count} {kind} task(s)",
            f"task={kind}:{_show(index)}",
            f"Use an index in 0..{count - 1}, or add the task's address to cluster[{kind!r}]",
        )
    return kind, index


def parse_tf_config(config: Mapping[str, Any] | str, *, source: str = "TF_CONFIG") -> Cluster:
    """Turn a TF_CONFIG (dict or JSON text) into a ``Cluster``; malformed input raises ``ClusterError``.

    Example:
        >>> c = parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"], "ps": ["c:1"]},'
        ...                     ' "task": {"type": "ps", "index": 0}}')
        >>> c.rank is None, c.world_size, c.chief_address
        (True, 2, 'a:1')
    """
    config = _load(config)
    if "cluster" not in config:
        raise _fail(
            "has no 'cluster'",
            _show(dict(config)),
            f"Give the cluster, e.g. {_EXAMPLE}, or unset TF_CONFIG for a single process",
        )
    addresses = _parse_cluster(config["cluster"])
    if "task" not in config:
        raise _fail(
            "has no 'task'",
            _show(dict(config)),
            'Say which task this process is, e.g. "task": {"type": "worker", "index": 0}',
        )
    kind, index = _parse_task(config["task"], addresses)
    rpc_layer = config.get("rpc_layer")
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise _fail("'rpc_layer' is not a string", f"rpc_layer={_show(rpc_layer)}", 'Use e.g. "grpc", or leave it out')

    # The collective world in rank order: the chief (if any), then the workers.
    members = [(k, i, a) for k in COLLECTIVE_TASK_TYPES for i, a in enumerate(addresses.get(k, ()))]
    chief_address = members[0][2]
    master_addr, master_port = split_address(chief_address)
    my_address = addresses[kind][index]
    my_host = split_address(my_address)[0]
    same_host = [(k, i) for k, i, a in members if split_address(a)[0] == my_host]
    rank = local_rank = None
    if kind in COLLECTIVE_TASK_TYPES:
        rank = next(r for r, (k, i, _) in enumerate(members) if (k, i) == (kind, index))
        local_rank = same_host.index((kind, index))
    return Cluster(
        task_type=kind,
        task_index=index,
        rank=rank,
        world_size=len(members),
        local_rank=local_rank,
        local_world_size=len(same_host),
        addresses=addresses,
        chief_address=chief_address,
        master_addr=master_addr,
        master_port=master_port,
        rpc_layer=rpc_layer,
        source=source,
        evidence=(
            f"{'TF_CONFIG' if source == 'TF_CONFIG' else 'the TF_CONFIG-form dict'} names task {kind}:{index} "
            f"at {my_address}",
            f"the chief is {members[0][0]}:{members[0][1]} at {chief_address} (rank 0)",
        ),
    )
