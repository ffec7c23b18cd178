"""The per-process recorder: spans and collectives appended as tuples, nothing done while it is off.

Every caller checks `recorder.on` (one attribute read) before taking a time, so a recorder that is off
costs nothing else. In summary mode (`start(mode="summary")`) a span is one tuple appended (its category, start
and end, a wait's collectives: no name, no track), and the steps are folded in batches into what the step table needs, their
spans then dropped (`fold.py`). Times are nanoseconds of `clock` (default `time.perf_counter_ns`, the host's
monotonic clock); `clocks.align` measures their offset to the chief's, and `write` puts both in this worker's file.

    >>> rec = Recorder(rank=0, task="worker:0")
    >>> rec.start()
    >>> t = rec.now(); ...; rec.span("forward", "forward", t, rec.now(), step=3)
    >>> rec.write("traces/")            # traces/worker-0.json
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stratagem.errors import InputError
from stratagem.trace.fold import MODES, SPANS, SUMMARY, StepFolder, own_phases
from stratagem.trace.sample import StepSample

FORMAT = "stratagem-trace/1"
"""The `format` field of a worker's file."""

Clock = Callable[[], int]

_THREAD_NAMES = {"MainThread": "main"}


def worker_file(directory: str | Path, rank: int) -> Path:
    """Where worker `rank` writes its trace in `directory`."""
    return Path(directory) / f"worker-{rank}.json"


def _track_name(thread: threading.Thread) -> str:
    name = thread.name
    if name.startswith("stratagem-replica-"):
        return "replica " + name.removeprefix("stratagem-replica-")
    return _THREAD_NAMES.get(name, name)


class Recorder:
    """This process's spans and collectives (see the module docstring).

    Args:
        rank, task: this worker's rank and task name (the process's name in the merged trace).
        world_size: how many workers the job has.
        clock: nanoseconds of a monotonic clock; a test shifts it to check the alignment.
    """

    def __init__(self, *, rank: int, task: str, world_size: int = 1, clock: Clock = time.perf_counter_ns) -> None:
        self.rank = rank
        self.task = task
        self.world_size = world_size
        self.clock = clock
        self.on = False
        """Whether the hooks record now: True from `start` to `stop`, but off between the steps a sample skips."""
        self.recording = False
        """Whether a trace is under way (from `start` to `stop`), recording this step or not."""
        self.sample: StepSample | None = None
        """Summary mode's sample of steps (`sample_steps`); None: every step is recorded."""
        self.spans: list[tuple[str, str, int, int, str, int, dict[str, Any] | None]] = []
        """(category, name, start ns, end ns, track, step, args)."""
        self.collectives: list[list[Any]] = []
        """[seq, op, what, step, bytes, bucket, transport, arrived ns, done ns or None]: seq is the index here, the
        same on every worker, since every worker issues the same collectives in the same order."""
        self.clock_offset: dict[str, Any] = {"offset_ns": 0, "error_ns": 0, "samples": 0}
        self.role = "worker"
        """What the process is in the job: "worker", or, in a parameter-server job, "ps" or "chief" (a chief task
        of its own; a worker that coordinates stays "worker")."""
        self.file_name: str | None = None
        """The file `write` makes in its directory; None: `worker-<rank>.json`."""
        self._tracks: dict[int, str] = {}
        self.mode = SPANS
        self.folder: StepFolder | None = None
        """Summary mode's folded steps; None in full mode."""
        self.step = 0
        """The step the spans are filed under (the strategy's `run` count)."""
        self._step_from = 0  # full mode: the index in `spans` where the step under way began
        self._last_step: tuple[int, int] | None = None  # full mode: the last complete step's spans, as a slice
        self._phases: dict[str, int] | None = None  # `last_step_phases`, once worked out
        self._cpu_clock: Clock = time.thread_time_ns  # a sample's: the training thread's CPU time

    def start(self, clock: Clock | None = None, *, mode: str = SPANS) -> None:
        """Records from now on (`clock`: another clock than the one given at construction); `mode`: "spans"
        keeps every span, "summary" folds the steps' spans in batches (`fold.py`)."""
        check_mode(mode)
        if clock is not None:
            self.clock = clock
        self.mode = mode
        self.folder = StepFolder(self.collectives) if mode == SUMMARY else None
        self.sample = None
        self.on = self.recording = True

    def stop(self) -> None:
        self.on = self.recording = False

    def sample_steps(self, *, cpu_clock: Clock = time.thread_time_ns, **rule: Any) -> StepSample:
        """Records a sample of the steps from now on (`sample.py`: every step of a slow run, 1 in K of a fast one);
        summary mode only. The strategy must call `after_step` at every step's end on its training thread
        (the strategies whose `Traceable.samples_steps` is True do). `cpu_clock`: that thread's CPU ns; `rule`:
        `StepSample`'s cost_ns, budget and keep."""
        if self.folder is None:
            raise InputError(
                f"Only a trace in summary mode samples steps. Received: mode={self.mode!r}. Start the trace with "
                "mode='summary'."
            )
        self._cpu_clock = cpu_clock
        self.sample = StepSample(start=self.clock(), cpu_start=cpu_clock(), **rule)
        return self.sample

    def after_step(self, step: int) -> None:
        """Step `step` has ended (every step while a trace is under way, recorded or not): with steps sampled,
        decides whether the next one is recorded, and opens its window now (its input comes before it starts)."""
        sample = self.sample
        if sample is None or self.folder is None:
            return
        if not self.on and step + 1 < sample.next_step:  # most steps of a sample: no clock read, no call
            sample.num_steps += 1
            return
        now = self.clock()
        recorded = self.on
        if sample.next_records(step, recorded=recorded, now=now, cpu_now=self._cpu_clock()):
            if not recorded:
                self.folder.begin_window(now)
                self.on = True
        else:
            self.on = False

    def at_step(self, step: int) -> None:
        """The spans recorded from now on belong to `step`."""
        self.step = step

    def now(self) -> int:
        return self.clock()

    def track(self) -> str:
        """The calling thread's track: "main", "replica <i>", or the thread's own name."""
        ident = threading.get_ident()
        name = self._tracks.get(ident)
        if name is None:
            name = self._tracks[ident] = _track_name(threading.current_thread())
        return name

    def span(
        self, category: str, name: str, start: int, end: int, *, track: str | None = None, args: dict | None = None
    ) -> None:
        """A span of the calling thread (or of `track`) from `start` to `end` (ns of `clock`)."""
        folder = self.folder
        if folder is not None:  # summary mode: the least work on the training thread (`fold.py`)
            folder.spans.append((category, start, end, (args or {}).get("seqs", []) if category == "wait" else None))
            if category == "step":
                folder.end_step(self.step, end)
                self._phases = None
            return
        self.spans.append((category, name, start, end, track or self.track(), self.step, args))
        if category == "step":  # the end of `strategy.run`: its replicas are done
            self._last_step = (self._step_from, len(self.spans))
            self._step_from = len(self.spans)
            self._phases = None

    def last_step_phases(self) -> dict[str, int] | None:
        """Nanoseconds of the last complete step's own work in forward, backward and the optimizer step (its waits
        painted out, `timeline.py`), or None before one; what the straggler warning refines "compute" with.
        Worked out once per step (it is asked at each sum's start)."""
        if self._phases is None:
            self._phases = self._own_phases()
        return self._phases

    def _own_phases(self) -> dict[str, int] | None:
        if self.folder is not None:
            return self.folder.last_phases()
        if self._last_step is None:
            return None
        spans = self.spans[self._last_step[0] : self._last_step[1]]
        return own_phases([(s[0], s[2], s[3], None) for s in spans], min(s[2] for s in spans), spans[-1][3])

    def collective(self, op: str, what: str, step: int, nbytes: int, transport: str, bucket: int | None = None) -> int:
        """A cross-worker collective this worker enters now; returns its sequence number, for `done`."""
        seq = len(self.collectives)
        self.collectives.append([seq, op, what, step, nbytes, bucket, transport, self.clock(), None])
        return seq

    def done(self, seq: int, at: int | None = None) -> None:
        """Collective `seq` has completed (now, or at `at`); the first report counts."""
        if seq >= len(self.collectives):  # entered in a trace since cleared (its wait came after the trace ended)
            return
        record = self.collectives[seq]
        if record[8] is None:
            record[8] = self.clock() if at is None else at

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "rank": self.rank,
            "task": self.task,
            "world_size": self.world_size,
            "role": self.role,
            "clock": self.clock_offset,
            "mode": self.mode,
            "spans": [list(s) for s in self.spans],
            "collectives": self.collectives,
            "steps": [] if self.folder is None else self.folder.steps,
            "stretches": [] if self.folder is None else self.folder.stretches,
            "sample": None if self.sample is None else self.sample.to_dict(),
        }

    def write(self, directory: str | Path) -> Path:
        """Writes this worker's file in `directory` (made if missing); returns its path."""
        path = worker_file(directory, self.rank) if self.file_name is None else Path(directory) / self.file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        tmp.replace(path)
        return path

    def clear(self) -> None:
        self.spans.clear()
        self.collectives.clear()
        self._step_from, self._last_step, self._phases = 0, None, None
        if self.folder is not None:
            self.folder = StepFolder(self.collectives)
        self.sample = None


def check_mode(mode: str) -> None:
    """Refuses a trace mode other than "spans" and "summary"."""
    if mode not in MODES:
        raise InputError(
            f"A trace's mode is one of {', '.join(map(repr, MODES))}. Received: mode={mode!r}. Pass mode='spans' "
            "for every span, or mode='summary' for the step table alone."
        )


@contextlib.contextmanager
def spanning(
    recorder: Recorder | None, category: str, name: str, *, track: str | None = None, **args: Any
) -> Iterator[None]:
    """The block as a span of `recorder` (on the calling thread, or on `track`), while it records; nothing otherwise.

    Example:
        >>> with spanning(strategy_recorder, "backup", "backup of step 12"):
        ...     save()
    """
    if recorder is None or not recorder.on:
        yield
        return
    start = recorder.now()
    try:
        yield
    finally:
        recorder.span(category, name, start, recorder.now(), track=track, args=args or None)
