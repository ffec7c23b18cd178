"""`fit(..., trace=DIR)`: the run's steps traced on every worker, merged by the chief into DIR/trace.json.gz.

The strategy records (it must be a `stratagem.trace.Traceable`; the others are refused before any work). Every
worker enters the trace where fit starts its first epoch and leaves it after the last, writing its own
`worker-<rank>.json`; a barrier then lets the chief read every file and merge them (docs/trace.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.trace import Traceable
from stratagem.trace.merge import merge
from stratagem.trace.recorder import Recorder


def check_trace(strategy: Strategy, directory: str | Path | None) -> None:
    """Refuses `trace=` for a strategy that cannot record its steps, or a value that is not a directory name."""
    if directory is None:
        return
    if not isinstance(directory, (str, Path)) or not str(directory):
        raise InputError(
            f"trace must name a directory. Received: trace={directory!r}. Pass a path such as trace='traces/'."
        )
    if not isinstance(strategy, Traceable):
        raise InputError(
            f"{type(strategy).__name__} does not record traces yet. Received: trace={str(directory)!r}. Use "
            "MultiWorkerMirroredStrategy (docs/trace.md lists the strategies traced), or leave trace out."
        )


@contextlib.contextmanager
def traced_run(strategy: Strategy, directory: str | Path | None, *, is_chief: bool) -> Iterator[Recorder | None]:
    """Traces the steps run inside the block into `directory` (nothing when None). On a clean exit every worker
    waits for the others' files and the chief merges them into DIR/trace.json.gz; yields the recorder."""
    if directory is None:
        yield None
        return
    assert isinstance(strategy, Traceable), "check_trace refuses the others before any work"
    merged = Path(directory) / "trace.json.gz"
    with strategy.trace(directory) as recorder:
        yield recorder
    if not strategy.writes_every_file:
        strategy.barrier()  # every worker's file is written before the chief reads them
    if is_chief:
        merge(directory, merged)
