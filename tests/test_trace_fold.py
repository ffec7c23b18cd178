"""Summary mode folds the steps in batches (issue 42, item 6): the same integers as painting each step alone at its
end, which is what summary mode did before, on random steps: replicas' spans overlapping, waits inside backward,
collectives done late or never, spans of unknown categories, zero-length ones. No process group."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stratagem.trace import Recorder, fold
from stratagem.trace.fold import own_phases
from stratagem.trace.timeline import PHASES, Timeline, paint_spans

CATEGORIES = ("input", "forward", "backward", "optimizer", "wait", "rpc")


class EagerFolder:
    """Each step painted alone as it ends: summary mode as it was before the batches (the reference)."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self.stretches: list[list[int]] = []
        self._window_start: int | None = None
        self._previous: Timeline | None = None
        self._next_seq = 0

    def fold(self, step: int, end: int, spans: list[tuple[Any, ...]], collectives: list[list[Any]]) -> None:
        start = self._window_start
        if start is None:
            start = min((s[1] for s in spans), default=end)
        timeline = paint_spans(spans, {})
        t = timeline.totals(start, end)
        totals = [t["peers"] + t["transfer"] if label == "wait" else t[label] for label in fold.FOLDED]
        waits = [[s[1], s[2], (s[3] or {}).get("seqs", [])] for s in spans if s[0] == "wait"]
        self.steps.append([step, start, end, totals, waits])
        while self._next_seq < len(collectives) and collectives[self._next_seq][7] <= end:
            seq = self._next_seq
            arrived = collectives[seq][7]
            before = collectives[seq - 1][8] if seq > 0 else None
            since = min(start if before is None else before, arrived)
            phases = timeline.totals(max(since, start), arrived)
            if since < start and self._previous is not None:
                earlier = self._previous.totals(since, start)
                phases = {label: phases[label] + earlier[label] for label in phases}
            self.stretches.append([seq, *(phases[phase] for phase in PHASES)])
            self._next_seq += 1
        self._previous = timeline
        self._window_start = end


def _random_job(rng: random.Random, steps: int) -> list[tuple[Any, ...]]:
    """What a worker records, in order: ("span", category, start, end, args), ("collective", arrived, done or
    None), ("step", start, end); times in ns, a step about 1 ms."""
    events: list[tuple[Any, ...]] = []
    t = rng.randrange(10**9)
    pending: list[int] = []
    seq = 0
    for _ in range(steps):
        begin = t
        t += rng.randrange(0, 300_000)
        events.append(("span", "input", begin + rng.randrange(-50_000, 50_000), t, None))
        step_start = t
        for _ in range(rng.randrange(1, 5)):  # replicas' spans overlap; some empty, some of other categories
            a = step_start + rng.randrange(0, 800_000)
            b = a + rng.choice([0, rng.randrange(1, 600_000)])
            category = rng.choice(CATEGORIES)
            args = None
            if category == "wait":
                events.append(("collective", a, rng.choice([None, a + rng.randrange(0, 900_000), b])))
                pending.append(seq)
                args = {"seqs": [seq]} if rng.random() < 0.9 else {}
                seq += 1
            events.append(("span", category, a, b, args))
        if rng.random() < 0.2:  # a collective that arrived before this step's window began
            events.append(("collective", begin - rng.randrange(0, 2_000_000), None))
            seq += 1
        t = step_start + rng.randrange(900_000, 1_200_000)
        events.append(("step", step_start, t))
    return events


def _replay(events: list[tuple[Any, ...]]) -> tuple[dict[str, Any], EagerFolder]:
    """The events through a recorder in summary mode, and through the reference, with each collective's end
    known from its time on (a callback reports it then)."""
    rec = Recorder(rank=0, task="worker:0")
    rec.start(clock=lambda: 0, mode="summary")
    eager, spans = EagerFolder(), []
    planned: list[tuple[int, int]] = []  # (done, seq)
    step = 0

    def report_done(now: int) -> None:
        for done, seq in [p for p in planned if p[0] <= now]:
            rec.done(seq, at=done)
            planned.remove((done, seq))

    for event in events:
        if event[0] == "collective":
            seq = rec.collective("all_reduce", "gradients", step, 64, "gloo")
            rec.collectives[seq][7] = event[1]
            if event[2] is not None:
                planned.append((event[2], seq))
        elif event[0] == "span":
            _, category, a, b, args = event
            rec.span(category, category, a, b, track="main", args=args)
            spans.append((category, a, b, args))
        else:
            step += 1
            rec.at_step(step)
            report_done(event[2])
            rec.span("step", f"step {step}", event[1], event[2], track="main")
            spans.append(("step", event[1], event[2], None))
            eager.fold(step, event[2], spans, rec.collectives)
            spans = []
    return rec.to_dict(), eager


@pytest.mark.parametrize("batch", [1, 3, 7, 512])
def test_steps_folded_in_batches_equal_each_step_painted_alone(monkeypatch, batch):
    monkeypatch.setattr(fold, "BATCH", batch)
    for seed in range(12):
        written, eager = _replay(_random_job(random.Random(seed), steps=25))
        assert written["steps"] == eager.steps, seed
        assert written["stretches"] == eager.stretches, seed
        assert written["spans"] == []


def test_the_last_steps_totals_are_read_without_folding_the_batch(monkeypatch):
    monkeypatch.setattr(fold, "BATCH", 512)
    rec = Recorder(rank=0, task="worker:0")
    rec.start(mode="summary")
    eager = EagerFolder()
    for step, event in enumerate([e for e in _random_job(random.Random(5), steps=6) if e[0] == "step"], start=1):
        rec.at_step(step)
        rec.span("forward", "forward", event[1], event[1] + 100, track="main")
        rec.span("step", f"step {step}", event[1], event[2], track="main")
        eager.fold(step, event[2], [("forward", event[1], event[1] + 100, None), ("step", *event[1:], None)], [])
        phases = rec.last_step_phases()
        assert phases is not None and list(phases.values()) == eager.steps[-1][3][1:4]
        assert rec.folder.spans  # nothing folded yet: the batch is not full
    assert rec.folder.steps == eager.steps


def test_own_phases_in_one_sweep_equal_the_painted_timeline():
    rng = random.Random(0)
    for _ in range(300):
        spans = []
        for _ in range(rng.randrange(0, 9)):
            a = rng.randrange(0, 100)
            spans.append((rng.choice(CATEGORIES + ("step",)), a, a + rng.randrange(-5, 60), None))
        start, end = rng.randrange(0, 60), rng.randrange(40, 160)
        painted = paint_spans(spans, {}).totals(start, end) if end > start else dict.fromkeys(fold.OWN, 0)
        assert own_phases(spans, start, end) == {label: painted[label] for label in fold.OWN}, (spans, start, end)


def test_spans_recorded_by_several_threads_at_once_are_each_kept_whole():
    """Mirrored's replica threads record their spans at the same time: each span must stay one record."""
    import sys
    import threading

    rec = Recorder(rank=0, task="worker:0")
    rec.start(clock=lambda: 0, mode="summary")
    rec.at_step(1)
    per_thread, length = 3000, 7

    def replica(t: int) -> None:
        for i in range(per_thread):
            start = 10**9 + (t * per_thread + i) * 100
            rec.span("forward", "forward", start, start + length, track=f"replica {t}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=replica, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    rec.span("step", "step 1", 10**9, 10**9 + 4 * per_thread * 100, track="main")
    [(step, start, end, totals, waits)] = rec.to_dict()["steps"]
    assert totals[fold.FOLDED.index("forward")] == 4 * per_thread * length
