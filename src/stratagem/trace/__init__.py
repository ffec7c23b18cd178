"""One timeline of every worker: what each step spent its time on, and who made the others wait.

The package, in the order a trace is made and read:

- `recorder.py`: `Recorder`, the cheap per-process recorder: spans (input, forward, backward, optimizer
  step, waits, whole steps) and cross-worker collectives appended as tuples; nothing happens while it is off.
  Each worker writes its own file (`worker-<rank>.json`).
- `clocks.py`: each worker's clock offset to the chief's, measured by round-trip pings through the job's
  store (the sample of least delay), with its error bound; or by the chief itself, through round trips it makes
  (`measure`: a parameter server's RPCs).
- `merge.py`: the worker files, on the chief's clock, as one Chrome trace-event file that Perfetto and
  chrome://tracing open: a process per worker, a track per thread and per transport, flow arrows joining
  the k-th collective of every worker.
- `timeline.py`: each worker's time, painted into non-overlapping labelled pieces.
- `summary.py`: per step and worker, input, compute, waiting for peers, transfer and idle (they add up to
  the step), and the late worker named by its arrival at the collectives (`late.py`), as a report with a
  text and a JSON rendering, and a PNG of the breakdown.
- `fold.py`: summary mode, the steps' spans folded in batches into what the step table needs.
- `sample.py`: which steps summary mode records when `fit` leaves it on (every step of a slow run, 1 in K of a
  fast one, keeping its cost near 1% of a step).
- `pipeline.py`: the pipeline's bubble measured from the stages' spans, beside GPipe's (S-1)/(M+S-1).
- `functions.py`: the report of a parameter-server job's trace (no step shared, no collective): each worker's
  functions and what they spent their time on, each server's updates; `summary.report` picks it.
- `traceable.py`: `Traceable`, the one member a strategy declares to be traced (`trace(directory)`), which
  `fit(..., trace=DIR)` and `stratagem train --trace DIR` look for.

Left on by `fit` and `stratagem train` in summary mode on a sample of the steps (MirroredStrategy and
MultiWorkerMirroredStrategy; `trace=False` turns it off). Every step is traced by `stratagem launch --trace DIR`
(STRATAGEM_TRACE), or for a range of steps by `with strategy.trace(DIR):` on any `Traceable` strategy, or
`fit(..., trace=DIR)`. Read with `stratagem trace summary DIR`.
"""

from __future__ import annotations

from stratagem.trace.recorder import Recorder
from stratagem.trace.traceable import Traceable

__all__ = ["Recorder", "Traceable"]
