"""Expand SLURM's compressed host lists (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``).

A host list is a comma-separated list of host patterns; a pattern mixes literal text with
bracketed sets of numbers and ranges, and several brackets multiply out, in order::

    node[01-03,07],gpu5     -> node01 node02 node03 node07 gpu5
    rack[1-2]-n[8-10]       -> rack1-n8 rack1-n9 rack1-n10 rack2-n8 rack2-n9 rack2-n10

A range keeps the zero padding of its lower bound (``[08-10]`` -> ``08 09 10``), as SLURM does.
"""

from __future__ import annotations

import itertools
import re

from stratagem.errors import ClusterError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _fail(what: str, nodelist: str, fix: str) -> ClusterError:
    return ClusterError(f"SLURM host list {what}. Received: {nodelist!r}. Fix: {fix}")


def _split_top_level(text: str, nodelist: str) -> list[str]:
    """Split on commas that are outside brackets, checking that brackets balance."""
    parts, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            if depth:
                raise _fail("has nested brackets", nodelist, "write ranges as name[1-3,5], one level deep")
            depth = 1
        elif char == "]":
            if not depth:
                raise _fail("has a ']' without '['", nodelist, "balance the brackets")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:position])
            start = position + 1
    if depth:
        raise _fail("has a '[' without ']'", nodelist, "balance the brackets")
    parts.append(text[start:])
    return parts


def _expand_set(body: str, nodelist: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item)
        if not match:
            raise _fail(f"has a bad range [{body}]", nodelist, "use numbers and ranges such as [1-4,7]")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise _fail(f"has a descending range [{item}]", nodelist, f"write it as [{high}-{low}]")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host named by a SLURM host list, in SLURM's order.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    text = nodelist.strip()
    if not text:
        raise _fail("is empty", nodelist, "run inside a SLURM allocation (srun/sbatch) or set the variable")
    hosts: list[str] = []
    for pattern in _split_top_level(text, nodelist):
        if not pattern:
            raise _fail("has an empty entry", nodelist, "remove the stray comma")
        # re.split with a group keeps the bracket bodies at the odd positions.
        pieces = re.split(r"\[([^\]]*)\]", pattern)
        choices = [
            _expand_set(piece, nodelist) if odd else [piece]
            for odd, piece in zip(itertools.cycle((False, True)), pieces)
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's ``2(x3),1`` -> ``[2, 2, 2, 1]`` (tasks on each node, in node order).

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE.match(item.strip())
        if not match:
            raise ClusterError(
                f"SLURM_TASKS_PER_NODE has a bad entry {item!r}. Received: {value!r}. "
                "Fix: expect the form 2(x3),1; set SLURM_NTASKS_PER_NODE (srun --ntasks-per-node) instead."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
