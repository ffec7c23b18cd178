"""The pipeline's bubble, measured from a trace of ModelParallelStrategy: the share of the stages' time in a step
during which a stage had no micro-batch to work on, beside GPipe's (S-1)/(M+S-1) for S stages and M micro-batches.

Each stage's forward and backward of each micro-batch is a span on the track "stage <s>" (`model_parallel/
pipeline.py`). A step's pipeline window runs from the first stage's first start to the last end; over S stages
it offers S x window of stage time, of which the spans fill `busy`: the bubble is 1 - busy / (S x window).
GPipe's figure assumes every stage takes as long on every micro-batch, forward and backward alike.

    >>> bubble = measure_bubble(job.workers[0])
    >>> bubble.median, bubble.gpipe
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from stratagem.trace.merge import WorkerTrace

STAGE_TRACK = "stage "


@dataclass(frozen=True)
class PipelineBubble:
    """The bubble of each step of a pipelined worker, and GPipe's figure for its shape."""

    num_stages: int
    num_micro_batches: int
    per_step: dict[int, float]
    """Step -> the measured bubble fraction."""

    @property
    def median(self) -> float:
        return statistics.median(self.per_step.values())

    @property
    def gpipe(self) -> float:
        """(S-1)/(M+S-1): the stages' idle share of GPipe's schedule when every piece of work takes as long."""
        s, m = self.num_stages, self.num_micro_batches
        return (s - 1) / (m + s - 1)

    def describe(self) -> str:
        return (
            f"pipeline: {self.num_stages} stages x {self.num_micro_batches} micro-batches: bubble {self.median:.1%} of "
            f"the stages' time (median of {len(self.per_step)} steps), GPipe's (S-1)/(M+S-1) = {self.gpipe:.1%}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median": round(self.median, 4), "gpipe": round(self.gpipe, 4)}


def measure_bubble(worker: WorkerTrace) -> PipelineBubble | None:
    """The bubble of `worker`'s pipelined steps, or None when it has no stage track (no pipeline, summary mode)."""
    by_step: dict[int, list[tuple[int, int, int, int]]] = {}  # step -> (stage, micro-batch, start, end)
    for s in worker.spans:
        if s.track.startswith(STAGE_TRACK) and s.category in ("forward", "backward") and s.args:
            by_step.setdefault(s.step, []).append((s.args["stage"], s.args["micro_batch"], s.start, s.end))
    if not by_step:
        return None
    num_stages = 1 + max(stage for spans in by_step.values() for stage, _, _, _ in spans)
    num_micro = 1 + max(micro for spans in by_step.values() for _, micro, _, _ in spans)
    per_step = {}
    for step, spans in sorted(by_step.items()):
        window = max(end for *_, end in spans) - min(start for _, _, start, _ in spans)
        busy = sum(end - start for _, _, start, end in spans)
        if window > 0:
            per_step[step] = round(1 - busy / (num_stages * window), 4)
    return PipelineBubble(num_stages, num_micro, per_step) if per_step else None
