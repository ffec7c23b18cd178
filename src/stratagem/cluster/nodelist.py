"""Read SLURM's compressed host lists (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``).

A host list is a comma-separated list of host patterns; a pattern mixes literal text with
bracketed sets of numbers and ranges, and several brackets multiply out, in order::

    node[01-03,07],gpu5     -> node01 node02 node03 node07 gpu5
    rack[1-2]-n[8-10]       -> rack1-n8 rack1-n9 rack1-n10 rack2-n8 rack2-n9 rack2-n10

A range keeps the zero padding of its lower bound (``[08-10]`` -> ``08 09 10``), as SLURM does.

Nothing is expanded that is not asked for: `first_host` (all a rendezvous needs) and
`tasks_on_node` check the whole value and answer in time and memory proportional to its
length, whatever the ranges or repeat counts say (``n[1-100000000]``, ``2(x10000000000)``).
`expand_nodelist` and `expand_tasks_per_node` build the full lists only up to
``MAX_HOSTS`` entries and refuse more. Numbers have at most 18 ASCII digits.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from stratagem.cluster.spec import show
from stratagem.errors import ClusterError

MAX_HOSTS = 100_000
"""The most hosts (or nodes) a full expansion builds; the largest SLURM clusters have fewer."""

_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
_TASKS_PER_NODE = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,18})\))?")

# A bracket set as (lower bound as written, upper bound): the written form keeps the zero padding.
_Set = list[tuple[str, int]]


def _fail(what: str, nodelist: object, fix: str) -> ClusterError:
    return ClusterError(f"SLURM host list {what}. Received: {show(nodelist)}. {fix}")


def _split_top_level(text: str, nodelist: str) -> list[str]:
    """Split on commas that are outside brackets, checking that brackets balance."""
    parts, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            if depth:
                raise _fail("has nested brackets", nodelist, "Write ranges as name[1-3,5], one level deep")
            depth = 1
        elif char == "]":
            if not depth:
                raise _fail("has a ']' without '['", nodelist, "Balance the brackets")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:position])
            start = position + 1
    if depth:
        raise _fail("has a '[' without ']'", nodelist, "Balance the brackets")
    parts.append(text[start:])
    return parts


def _parse_set(body: str, nodelist: str) -> _Set:
    """``01-03,07`` -> ``[('01', 3), ('07', 7)]``, checked but not expanded."""
    ranges: _Set = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise _fail(
                f"has a bad range [{show(body, 40)[1:-1]}]",
                nodelist,
                "Use numbers (at most 18 digits) and ranges such as [1-4,7]",
            )
        low, high = match.group(1), match.group(2)
        if high is not None and int(high) < int(low):
            raise _fail(f"has a descending range [{item}]", nodelist, f"Write it as [{high}-{low}]")
        ranges.append((low, int(low) if high is None else int(high)))
    return ranges


def _patterns(nodelist: str) -> list[list[str | _Set]]:
    """Each host pattern as its pieces: literal text, and bracket sets at the odd positions."""
    if not isinstance(nodelist, str):
        raise _fail("is not a string", nodelist, "Pass the variable's text")
    text = nodelist.strip()
    if not text:
        raise _fail("is empty", nodelist, "Run inside a SLURM allocation (srun/sbatch) or set the variable")
    patterns = []
    for pattern in _split_top_level(text, nodelist):
        if not pattern:
            raise _fail("has an empty entry", nodelist, "Remove the stray comma")
        # re.split with a group keeps the bracket bodies at the odd positions.
        pieces = re.split(r"\[([^\]]*)\]", pattern)
        patterns.append(
            [
                _parse_set(piece, nodelist) if odd else piece
                for odd, piece in zip(itertools.cycle((False, True)), pieces)
            ]
        )
    return patterns


def _values(ranges: _Set) -> Iterator[str]:
    for low, high in ranges:
        for number in range(int(low), high + 1):
            yield str(number).zfill(len(low))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (the master of a job), without expanding the list.

    The whole list is checked, so a malformed one is an error even past its first host.

    Example:
        >>> first_host("node[07-100000000],gpu5")
        'node07'
    """
    pieces = _patterns(nodelist)[0]
    return "".join(piece if isinstance(piece, str) else piece[0][0] for piece in pieces)


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host named by a SLURM host list, in SLURM's order (at most ``MAX_HOSTS``).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    patterns = _patterns(nodelist)
    total = 0
    for pieces in patterns:
        count = 1
        for piece in pieces:
            if not isinstance(piece, str):
                count *= sum(high - int(low) + 1 for low, high in piece)
                if count > MAX_HOSTS:  # stop multiplying: the number itself could grow without bound
                    break
        total += count
        if total > MAX_HOSTS:
            raise _fail(
                f"names more than {MAX_HOSTS} hosts",
                nodelist,
                "Check the ranges; to find the master host only, use first_host",
            )
    hosts: list[str] = []
    for pieces in patterns:
        choices = [[piece] if isinstance(piece, str) else list(_values(piece)) for piece in pieces]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _tasks_entries(value: str) -> Iterator[tuple[int, int]]:
    """SLURM_TASKS_PER_NODE's entries as (tasks, repeat), every entry checked."""
    if not isinstance(value, str):
        raise ClusterError(f"SLURM_TASKS_PER_NODE is not a string. Received: {show(value)}. Pass the variable's text.")
    for item in value.split(","):
        match = _TASKS_PER_NODE.fullmatch(item.strip())
        if not match:
            raise ClusterError(
                f"SLURM_TASKS_PER_NODE has a bad entry {show(item, 40)}. Received: {show(value)}. "
                "Expect the form 2(x3),1 (numbers of at most 9 and 18 digits); set SLURM_NTASKS_PER_NODE "
                "(srun --ntasks-per-node) instead."
            )
        yield int(match.group(1)), int(match.group(2) or 1)


def tasks_on_node(value: str, node: int) -> int:
    """The tasks SLURM_TASKS_PER_NODE gives 0-based `node`, without expanding the list.

    Example:
        >>> tasks_on_node("2(x10000000000),1", 9999999999)
        2

    Raises:
        ClusterError: a malformed value, or `node` beyond the nodes it lists.
    """
    entries = list(_tasks_entries(value))  # every entry checked, past `node` too
    first = 0
    for tasks, repeat in entries:
        if node < first + repeat:
            return tasks
        first += repeat
    raise ClusterError(
        f"SLURM_NODEID is beyond SLURM_TASKS_PER_NODE. Received: SLURM_NODEID={node}, "
        f"SLURM_TASKS_PER_NODE={show(value)} ({first} nodes). Run under srun, which sets both."
    )


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's ``2(x3),1`` -> ``[2, 2, 2, 1]`` (tasks on each node, at most ``MAX_HOSTS``).

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    entries = list(_tasks_entries(value))
    if sum(repeat for _, repeat in entries) > MAX_HOSTS:
        raise ClusterError(
            f"SLURM_TASKS_PER_NODE lists more than {MAX_HOSTS} nodes. Received: {show(value)}. "
            "Check the repeat counts (x N); to read one node's count, use tasks_on_node."
        )
    return [tasks for tasks, repeat in entries for _ in range(repeat)]
