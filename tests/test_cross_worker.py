"""Collective waits across workers, with a fake store and fake work handles: no process group needed."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import stop_process

from stratagem.cluster import free_ports
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
    """A work handle as Gloo's: completed when its future is; wait() re-raises the collective's error."""

    def __init__(self) -> None:
        self.future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.future.value()
        return True


class FakeNcclWork:
    """A work handle as ProcessGroupNCCL's: the future is done as soon as the all-reduce is queued, the result
    lands in `tensor` only when the (simulated) kernel finishes, and wait() is what orders the reader after it."""

    def __init__(self, tensor: torch.Tensor, result: torch.Tensor, run_seconds: float) -> None:
        self.tensor, self.result = tensor, result
        self.future = torch.futures.Future()
        self.future.set_result([tensor])  # queued: done() is true at once
        self.finished = threading.Event()
        self.waited = False
        self.timer = threading.Timer(run_seconds, self._finish)
        self.timer.daemon = True
        self.timer.start()

    def _finish(self) -> None:
        self.tensor.copy_(self.result)
        self.finished.set()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited = True
        return True


@pytest.fixture
def make():
    def build(store: FakeStore, **kwargs) -> CrossWorker:
        options = dict(timeout=5.0, roll_call_seconds=0.2)
        options.update(kwargs)
        return CrossWorker(store, rank=0, task_names=["worker:0", "worker:1", "worker:2"], **options)

    return build


def test_an_nccl_collective_is_waited_for_until_the_sum_has_landed(make):
    # The future of NCCL work is done once the collective is queued; reading then would see the old value.
    tensor = torch.tensor([1.0, 0.0])
    work = FakeNcclWork(tensor, torch.tensor([3.0, 2.0]), run_seconds=0.2)
    make(FakeStore()).wait([work], what="end-of-data agreement", step=0)
    assert tensor.tolist() == [3.0, 2.0]
    assert work.waited  # the current stream was ordered after the collective's


def test_an_nccl_collective_that_never_finishes_times_out_although_its_future_is_done(make):
    store = FakeStore()
    store.set("stratagem/rollcall/5/1", "here")
    store.set("stratagem/rollcall/5/2", "here")
    work = FakeNcclWork(torch.zeros(1), torch.ones(1), run_seconds=30.0)
    try:
        with pytest.raises(CollectiveTimeoutError, match=r"the gradient all-reduce of step 5 timed out"):
            make(store, timeout=0.3).wait([work], what="gradient all-reduce", step=5)
    finally:
        work.timer.cancel()


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
    with pytest.raises(
        ReplicaError,
        match=r"worker:0 \(rank 0\): the gradient all-reduce of step 7 failed "
        r"\(Connection closed by peer .*\) after waiting for the other workers; "
        r"lost: worker:1 \(rank 1\)\. "
        r"Steps last reported: worker:0: 7, worker:1: 6, worker:2: -",
    ):
        cw.wait([work], what="gradient all-reduce", step=7)


def test_a_collective_that_never_completes_times_out_and_says_nobody_is_gone(make):
    store = FakeStore()
    cw = make(store, timeout=0.3)
    store.set("stratagem/rollcall/3/1", "here")
    store.set("stratagem/rollcall/3/2", "here")
    with pytest.raises(
        CollectiveTimeoutError, match=r"step 3 timed out .* every task answered the roll call, so one is stuck"
    ):
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


@pytest.fixture
def stopped_chief():
    """A chief process that hosts the TCP store, then is stopped (SIGSTOP) with its connections open: its
    kernel still accepts, nobody answers. Yields a client of that store (rank 1's)."""
    port = free_ports(1)[0]
    chief = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from datetime import timedelta; import torch.distributed as dist\n"
                f"store = dist.TCPStore('127.0.0.1', {port}, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)\n"
                "store.set('stratagem/step/0', '5'); print('up', flush=True); time.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert chief.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=3))
        assert store.get("stratagem/step/0") == b"5"
        stop_process(chief.pid)
        yield store
    finally:
        chief.kill()
        chief.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_stopped_chief_is_named_within_the_timeout_not_waited_for_forever(stopped_chief, caplog):
    # The stall warning read the steps from the stopped chief's store without a bound: the worker hung there.
    cw = CrossWorker(
        stopped_chief,
        rank=1,
        task_names=["worker:0", "worker:1"],
        timeout=2.0,
        stall_warning_after=0.5,
        roll_call_seconds=0.2,
    )
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="stratagem.collective.cross_worker"):
        with pytest.raises(
            CollectiveTimeoutError,
            match=r"worker:1 \(rank 1\): the gradient all-reduce of step 6 timed "
            r"out .*the chief \(worker:0\), which hosts the rendezvous "
            r"store, is unreachable",
        ):
            cw.wait([FakeWork()], what="gradient all-reduce", step=6)
    assert time.monotonic() - start < 2.0 + 2.5
    assert "steps reached: unknown (the chief's store, worker:0, did not answer within 0.5 s)" in caplog.text
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"worker:1 \(rank 1\): the chief \(worker:0, rank 0\), which hosts "
        r"the rendezvous store, did not answer a read of the steps reached",
    ):
        cw.steps_reached(0.2)
    with pytest.raises(CollectiveTimeoutError, match=r"did not answer the heartbeat of step 7"):
        cw.heartbeat(7)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_shared_memory_meeting_at_a_stopped_chief_ends_within_the_timeout(stopped_chief):
    cw = CrossWorker(stopped_chief, rank=1, task_names=["worker:0", "worker:1"], timeout=1.5, roll_call_seconds=0.2)
    start = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"worker:1 \(rank 1\): the chief \(worker:0, rank 0\), which hosts "
        r"the rendezvous store, did not answer the shared-memory meeting",
    ):
        cw.connect_shared_memory(wanted=True)
    assert time.monotonic() - start < 1.5 + 0.2 + 1.5


# ---- the device path (NCCL): the host does not wait, a watchdog does ----------------------------------


class AbortRecorder:
    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()


class BrokenNcclWork(FakeNcclWork):
    """A handle whose is_completed() raises, as ProcessGroupNCCL's does once its work has an error."""

    def is_completed(self) -> bool:
        raise RuntimeError("NCCL error: remote process exited or there was a network error")


def raised_within(seconds: float, call) -> Exception:
    """The error `call()` raises once the watchdog has recorded one (polled, at most `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the test looks at which error it is
            return error
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing raised within {seconds} s")
        time.sleep(0.01)


def test_the_device_path_returns_before_the_collective_ends_and_orders_the_stream(make):
    tensor = torch.zeros(2)
    work = FakeNcclWork(tensor, torch.tensor([3.0, 2.0]), run_seconds=0.5)
    cw = make(FakeStore(), device_collectives=True, abort=AbortRecorder())
    try:
        start = time.monotonic()
        cw.wait([work], what="gradient all-reduce", step=0)
        assert time.monotonic() - start < 0.2 and not work.finished.is_set()  # the host ran ahead
        assert work.waited  # wait() was called at once: the current stream is ordered after the collective
        assert cw.watchdog is not None and cw.watchdog.is_alive()
        assert work.finished.wait(2.0)
        deadline = time.monotonic() + 2.0
        while cw.watchdog.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cw.watchdog.pending == 0  # seen complete and let go
        cw.check()
    finally:
        work.timer.cancel()
        cw.close()


def test_a_device_collective_that_never_ends_is_warned_about_then_raised_at_the_next_call(make, caplog):
    store = FakeStore()
    store.set("stratagem/rollcall/5/1", "here")
    store.set("stratagem/rollcall/5/2", "here")
    abort = AbortRecorder()
    cw = make(store, timeout=0.4, stall_warning_after=0.1, device_collectives=True, abort=abort)
    work = FakeNcclWork(torch.zeros(1), torch.ones(1), run_seconds=30.0)
    try:
        with caplog.at_level(logging.WARNING):
            cw.wait([work], what="gradient all-reduce", step=5)  # returns at once
            error = raised_within(3.0, cw.check)
        assert isinstance(error, CollectiveTimeoutError)
        assert re.search(
            r"worker:0 \(rank 0\): the gradient all-reduce of step 5 timed out .* every task answered "
            r"the roll call, so one is stuck",
            str(error),
        )
        assert "worker:0 has waited" in caplog.text  # the stall warning, from the watchdog's thread
        assert any(r.levelno == logging.ERROR and "step 5 timed out" in r.getMessage() for r in caplog.records)
        assert abort.calls == 1
        with pytest.raises(CollectiveTimeoutError, match=r"step 5 timed out"):
            cw.heartbeat(6)
        with pytest.raises(CollectiveTimeoutError, match=r"step 5 timed out"):
            cw.all_reduce_async([torch.ones(1)], what="gradient all-reduce", step=6)
        with pytest.raises(CollectiveTimeoutError, match=r"step 5 timed out"):
            cw.wait([], what="reduce", step=6)
        assert abort.calls == 1 and not cw.watchdog.is_alive()
    finally:
        work.timer.cancel()
        cw.close()


def test_a_device_handle_that_cannot_say_whether_it_completed_is_a_replica_error_at_the_next_call(make):
    store = FakeStore()
    store.set("stratagem/rollcall/2/1", "here")  # worker:2 never signs in
    abort = AbortRecorder()
    cw = make(store, device_collectives=True, abort=abort)
    work = BrokenNcclWork(torch.zeros(1), torch.ones(1), run_seconds=30.0)
    try:
        cw.wait([work], what="end-of-data agreement", step=2)
        error = raised_within(3.0, cw.check)
        assert isinstance(error, ReplicaError)
        assert re.search(
            r"the end-of-data agreement of step 2 failed \(NCCL error: remote process exited.*\) .*"
            r"lost: worker:2 \(rank 2\)",
            str(error),
        )
        with pytest.raises(ReplicaError, match=r"lost: worker:2 \(rank 2\)"):
            cw.wait([], what="gradient all-reduce", step=3)
        assert abort.calls == 1
    finally:
        work.timer.cancel()
        cw.close()


def test_close_ends_the_watchdog_thread_even_with_a_collective_pending(make):
    abort = AbortRecorder()
    cw = make(FakeStore(), device_collectives=True, abort=abort)
    work = FakeNcclWork(torch.zeros(1), torch.ones(1), run_seconds=30.0)
    try:
        before = set(threading.enumerate())
        cw.wait([work], what="gradient all-reduce", step=1)
        started = [t for t in set(threading.enumerate()) - before if t.name == "stratagem-collective-watchdog"]
        assert len(started) == 1 and cw.watchdog.is_alive()
        cw.close()
        assert not started[0].is_alive() and not cw.watchdog.is_alive() and abort.calls == 0
        assert cw.watchdog.pending == 0  # the handle let go
    finally:
        work.timer.cancel()


def test_an_idle_watchdog_polls_nothing():
    from stratagem.collective.watchdog import Watchdog

    class CountedWork:
        polls = 0

        def is_completed(self) -> bool:
            CountedWork.polls += 1
            return CountedWork.polls >= 3

    dog = Watchdog(
        timeout=5.0,
        stall_warning_after=1.0,
        on_stall=lambda *a: None,
        on_failure=lambda what, step, error: RuntimeError("unexpected"),
        abort=AbortRecorder(),
    )
    try:
        dog.watch([CountedWork()], what="gradient all-reduce", step=0)
        deadline = time.monotonic() + 2.0
        while dog.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dog.pending == 0 and CountedWork.polls == 3
        time.sleep(0.1)
        assert CountedWork.polls == 3 and dog.is_alive()  # asleep on its condition, not polling
        dog.check()
    finally:
        dog.close()


# ---- host reads after a device wait: checked, so a value from an aborted collective is never used ---------


class Aborted:
    """What the watchdog recorded for the collective the host has just read from."""

    def __init__(self) -> None:
        self.reads_checked = 0

    def __call__(self) -> None:
        self.reads_checked += 1
        raise CollectiveTimeoutError("worker:0 (rank 0): the gradient all-reduce of step 4 timed out")


def test_the_bucket_counts_read_on_the_host_are_checked_before_use():
    from stratagem.collective.buckets import GradientBuckets

    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    aborted = Aborted()
    buckets = GradientBuckets(
        ps, bucket_bytes=10**6, first_bucket_bytes=10**6, count_users=True, after_host_read=aborted
    )
    buckets.start(1.0)
    for p in ps:
        p.grad = torch.ones(3)
    buckets.finish(lambda tensor: tensor.zero_())  # an aborted all-reduce: the counts read 0, "nobody used it"
    with pytest.raises(CollectiveTimeoutError, match=r"step 4 timed out"):
        buckets.hand_out()
    with pytest.raises(CollectiveTimeoutError, match=r"step 4 timed out"):
        buckets.declared_total()
    assert aborted.reads_checked == 2


def test_the_worker_sum_counts_read_on_the_host_are_checked_before_use():
    from stratagem.collective.worker_sum import sum_gradients_across_workers

    class AbortedWorld:
        def all_reduce_(self, tensors, *, what, step):
            tensors[0].zero_()  # what an aborted collective may leave

        check = Aborted()

    params = [torch.nn.Parameter(torch.ones(2))]
    params[0].grad = torch.ones(2)
    with pytest.raises(CollectiveTimeoutError, match=r"step 4 timed out"):
        sum_gradients_across_workers(AbortedWorld(), [params], [0], 1.0, (0.0, 0), step=4)
    assert torch.equal(params[0].grad, torch.ones(2))  # left as it was, not handed a garbage sum


def test_a_collective_started_as_the_watchdog_aborts_the_group_raises_the_watchdogs_error(make, monkeypatch):
    store = FakeStore()
    store.set("stratagem/rollcall/8/1", "here")
    store.set("stratagem/rollcall/8/2", "here")
    abort = AbortRecorder()
    cw = make(store, timeout=0.3, device_collectives=True, abort=abort)
    work = FakeNcclWork(torch.zeros(1), torch.ones(1), run_seconds=30.0)

    def all_reduce_as_the_group_is_aborted(*args, **kwargs):
        # The host got past check() just before the watchdog fired; torch then finds no process group.
        assert abort.called.wait(3.0)
        raise RuntimeError("Default process group has not been initialized")

    try:
        cw.wait([work], what="gradient all-reduce", step=8)
        monkeypatch.setattr(dist, "all_reduce", all_reduce_as_the_group_is_aborted)
        with pytest.raises(CollectiveTimeoutError, match=r"the gradient all-reduce of step 8 timed out"):
            cw.all_reduce_async([torch.ones(1)], what="gradient all-reduce", step=9)
    finally:
        work.timer.cancel()
        cw.close()
