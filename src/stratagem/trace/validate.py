"""The checks a merged trace passes before anyone opens it: what Perfetto and chrome://tracing rely on.

Every complete event ("X") has ts, dur, pid and tid; the spans of each track nest (a span that starts
inside another ends inside it); every flow id has one start ("s") and one finish ("f").

    >>> problems(json.load(gzip.open("traces/trace.json.gz")))     # [] for a good file
"""

from __future__ import annotations

import collections
from typing import Any

TOLERANCE_US = 0.002
"""Times are rounded to the nanosecond (0.001 µs) one by one: a start and a duration may each be off by that."""


def problems(document: dict[str, Any]) -> list[str]:
    """What is wrong with a Chrome trace-event document, one line each; empty when nothing is."""
    found: list[str] = []
    events = document.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    tracks: dict[tuple[Any, Any], list[tuple[float, float, str]]] = collections.defaultdict(list)
    flows: dict[Any, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for event in events:
        phase = event.get("ph")
        if phase == "X":
            missing = [key for key in ("ts", "dur", "pid", "tid") if key not in event]
            if missing:
                found.append(f"complete event {event.get('name')!r} lacks {missing}")
                continue
            tracks[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"], event["name"]))
        elif phase in ("s", "t", "f"):
            flows[event.get("id")][phase] += 1
    for (pid, tid), spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[tuple[float, str]] = []
        for start, end, name in spans:
            while open_ends and start >= open_ends[-1][0] - TOLERANCE_US:
                open_ends.pop()
            if open_ends and end > open_ends[-1][0] + TOLERANCE_US:
                found.append(
                    f"pid {pid} tid {tid}: {name!r} [{start}, {end}] overlaps the end of {open_ends[-1][1]!r} "
                    f"({open_ends[-1][0]}) without nesting in it"
                )
            open_ends.append((end, name))
    for flow_id, phases in flows.items():
        if phases["s"] != 1 or phases["f"] != 1:
            found.append(f"flow {flow_id}: {phases['s']} start(s) and {phases['f']} finish(es), not one of each")
    return found
