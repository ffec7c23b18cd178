"""What `CrossWorker` tells a trace: each collective entered and ended, each wait for one (`stratagem.trace`).

Every call costs one attribute read while no recorder is on. A collective on the process group ends when the
thread waiting for it through `CrossWorker.wait` sees it done: a callback on its future would report the end
sooner, but runs Python on a Gloo thread, whose taking of the GIL from the training thread cost about 30 us of
that thread's CPU per collective here (benchmarks/reports/2026-12-07-cpu-2vcpu-trace-overhead.md). A collective waited for
elsewhere (FSDP2's own waits) asks for the callback. A sum through shared memory ends where it is made, the
calling thread having waited inside it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stratagem.trace.recorder import Recorder


class CollectiveTrace:
    """The collectives and waits of one `CrossWorker`, recorded into `recorder` while it is on."""

    def __init__(self) -> None:
        self.recorder: Recorder | None = None
        self._pending: dict[int, int] = {}  # id of a work handle -> its collective's sequence number
        self._backend: str | None = None  # the process group's backend, read once (a lookup per call costs)

    def enter(
        self, op: str, what: str, step: int, tensor: torch.Tensor, *, shared: bool = False, bucket: int | None = None
    ) -> int | None:
        """The collective entered now (`shared`: through shared memory, else the process group's backend);
        its sequence number, or None when nothing records."""
        recorder = self.recorder
        if recorder is None or not recorder.on:
            return None
        if shared:
            transport = "shared memory"
        else:
            transport = self._backend = self._backend or str(dist.get_backend())
        return recorder.collective(op, what, step, tensor.numel() * tensor.element_size(), transport, bucket)

    def summed_here(self, seq: int | None, what: str) -> None:
        """A shared-memory sum entered as `seq` is done: the thread waited inside it."""
        recorder = self.recorder
        if seq is None or recorder is None:
            return
        recorder.done(seq)
        record = recorder.collectives[seq]
        recorder.span("wait", what, record[7], record[8], args={"seqs": [seq]})

    def issued(self, seq: int | None, work: Any, *, callback: bool = False) -> None:
        """A process-group collective entered as `seq` runs as `work`; `waited` reports its end, or with
        `callback` (nobody waits for it through `CrossWorker.wait`) its future does."""
        recorder = self.recorder
        if seq is None or recorder is None:
            return
        self._pending[id(work)] = seq
        if not callback:
            return
        try:
            work.get_future().add_done_callback(lambda _: recorder.done(seq))
        except (AttributeError, RuntimeError):  # a work without a future: `waited` reports the end
            pass

    def wait_started(self) -> int | None:
        recorder = self.recorder
        return recorder.now() if recorder is not None and recorder.on else None

    def waited(self, start: int | None, works: list[Any], what: str) -> None:
        """The calling thread waited from `start` until now for `works`."""
        recorder = self.recorder
        if recorder is None or (start is None and not self._pending):
            return
        # A collective issued in a recorded step may be waited for in a step a sampled trace skips (`start` None):
        # it still ends here, or its entry would outlive it and a later work of the same id would end it.
        end = recorder.now()
        seqs = [self._pending.pop(id(w)) for w in works if id(w) in self._pending]
        for seq in seqs:
            recorder.done(seq, end)  # the future's report, when it came first, stands
        if start is not None:
            recorder.span("wait", what, start, end, args={"seqs": seqs})
