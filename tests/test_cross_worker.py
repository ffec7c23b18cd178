"""Collective waits across workers, with a fake store and fake work handles: no process group needed."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch

from stratagem.collective.cross_worker import CrossWorker
from stratagem.errors import CollectiveTimeoutError, ReplicaError


class FakeStore:
    def __init__(self, fail: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = fail

    def set(self, key: str, value: str) -> None:
        if self.fail:
            raise RuntimeError("Connection refused")
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        if self.fail:
            raise RuntimeError("Connection refused")
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        raise RuntimeError("Wait timeout")


class FakeWork:
    """A work handle completed through its future; waited on through the future, or (as Gloo's) through
    wait(timeout), which raises when the time runs out and re-raises the collective's error."""

    def __init__(self) -> None:
        self.future = torch.futures.Future()
        self._done = threading.Event()
        self.future.add_done_callback(lambda _: self._done.set())

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: timedelta) -> bool:
        if not self._done.wait(timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        self.future.value()
        return True


@pytest.fixture(params=[False, True], ids=["futures", "blocking-waits"])
def make(request):
    def build(store: FakeStore, **kwargs) -> CrossWorker:
        options = dict(timeout=5.0, roll_call_seconds=0.2, blocking_waits=request.param)
        options.update(kwargs)
        return CrossWorker(store, rank=0, task_names=["worker:0", "worker:1", "worker:2"], **options)

    return build


def test_a_completed_collective_returns(make):
    work = FakeWork()
    work.future.set_result(torch.ones(1))
    make(FakeStore()).wait([work], what="gradient all-reduce", step=1)


def test_a_failed_collective_names_the_tasks_missing_from_the_roll_call(make):
    store = FakeStore()
    cw = make(store)
    cw.heartbeat(7)
    store.set("stratagem/step/1", "6")
    store.set("stratagem/rollcall/7/2", "here")  # worker:2 survived and signed in; worker:1 did not
    work = FakeWork()
    work.future.set_exception(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
    with pytest.raises(ReplicaError, match=r"worker:0 \(rank 0\): the gradient all-reduce of step 7 failed "
                                           r"\(Connection closed by peer .*\) after waiting for the other workers; "
                                           r"lost: worker:1 \(rank 1\)\. "
                                           r"Steps last reported: worker:0: 7, worker:1: 6, worker:2: -"):
        cw.wait([work], what="gradient all-reduce", step=7)


def test_a_collective_that_never_completes_times_out_and_says_nobody_is_gone(make):
    store = FakeStore()
    cw = make(store, timeout=0.3)
    store.set("stratagem/rollcall/3/1", "here")
    store.set("stratagem/rollcall/3/2", "here")
    with pytest.raises(CollectiveTimeoutError, match=r"step 3 timed out .* every task answered the roll call, so one is stuck"):
        cw.wait([FakeWork()], what="reduce", step=3)


def test_a_stall_is_warned_about_before_the_timeout(make, caplog):
    store = FakeStore()
    cw = make(store, timeout=10.0, stall_warning_after=0.1)
    cw.heartbeat(4)
    store.set("stratagem/step/1", "3")
    work = FakeWork()
    threading.Timer(0.4, lambda: work.future.set_result(torch.ones(1))).start()
    with caplog.at_level(logging.WARNING, logger="stratagem.collective.cross_worker"):
        cw.wait([work], what="gradient all-reduce", step=4)
    assert "worker:0 has waited" in caplog.text and "worker:1: 3" in caplog.text


def test_a_lost_store_means_the_chief_is_gone(make):
    store = FakeStore()
    cw = make(store)
    store.fail = True
    work = FakeWork()
    work.future.set_exception(RuntimeError("Broken pipe"))
    with pytest.raises(ReplicaError, match=r"the chief \(worker:0\), which hosts the rendezvous store, is unreachable"):
        cw.wait([work], what="end-of-data agreement", step=2)
