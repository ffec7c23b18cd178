"""The placement log: operations per device and replica (replica threads and torch's autograd
threads included), copies with their bytes, off-device operations, steps, the report, no cost
when off. Expected counts are worked out by hand from the model and the code logged.

Cases that need a second device use `sgdev` (tests/placement_device.py) and run together in one
fresh process: the backend is process-wide, and torch sizes its autograd device threads at the
first backward pass of a process, so it must be registered before anything trains.
"""

from __future__ import annotations

import json
import threading

import placement_device
import pytest
import torch
import torch.nn.functional as F
from cases import make_batches, mlp
from conftest import cpu_registry

import stratagem as sg
from stratagem.diagnose import OffDeviceOp, apply_placement, capture_placement
from stratagem.errors import InputError
from stratagem.strategies.replica_context import ReplicaContext, enter_replica


def _trainer(strategy):
    """Distributes the MLP of tests/cases.py; returns train(sizes), which trains on batches of
    those sizes and returns, per replica step, its thread and how many dispatch modes were active."""
    base = mlp()
    model, optimizer = strategy.distribute(base, torch.optim.SGD(base.parameters(), lr=0.1))
    stacks = []

    def step(x, y):
        stacks.append((threading.current_thread().name, torch._C._len_torch_dispatch_stack()))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def train(sizes):
        stacks.clear()
        for x, y in strategy.distribute_dataset(make_batches((6,), torch.float32, sizes=sizes)):
            strategy.run(step, args=(x, y))
        return list(stacks)

    return train


# The MLP per step and replica, by hand: Linear(6,16) ReLU Linear(16,16) Tanh Linear(16,4).
# Forward: one addmm per Linear (3), one relu, one tanh. Backward: one threshold_backward (ReLU), one
# tanh_backward, and mm for each Linear's weight gradient (3) plus the input gradient of the last two (2): 5.
PER_STEP = {
    "aten::addmm": 3,
    "aten::relu": 1,
    "aten::tanh": 1,
    "aten::threshold_backward": 1,
    "aten::tanh_backward": 1,
    "aten::mm": 5,
}


def test_one_device_step_counts_every_operation_on_its_device():
    strategy = sg.OneDeviceStrategy("cpu")
    train = _trainer(strategy)
    with sg.log_placement() as log:
        train([8, 8, 5])
    assert log.steps == 3
    for op, n in PER_STEP.items():
        assert log.count(op=op, device="cpu", replica=0) == 3 * n, op
    summary = log.summary()
    assert summary.operations_per_device == {"cpu": log.count()}
    # "no replica": cutting the batches, outside strategy.run.
    assert summary.operations_per_replica == {"replica 0": log.count(replica=0), "no replica": log.count(replica=None)}
    assert summary.num_copies == 0 and summary.num_off_device == 0


def test_mirrored_replica_threads_are_logged_and_nothing_is_entered_without_a_log():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    try:
        train = _trainer(strategy)
        # The first step runs under the check that refuses a hand-written update of the shared parameters before
        # it runs (strategies/data_parallel/cpu_threads/hand_updates.py); no log: no other dispatch mode.
        assert sorted(train([8])) == [("MainThread", 1), ("stratagem-replica-1", 1)]
        # From the second step, no dispatch mode on any replica thread (the unlogged path pays nothing).
        assert sorted(train([8])) == [("MainThread", 0), ("stratagem-replica-1", 0)]
        assert capture_placement() is None
        with sg.log_placement() as log:
            logged = train([8, 7])
        assert sorted(logged) == [("MainThread", 1)] * 2 + [("stratagem-replica-1", 1)] * 2
        assert torch._C._len_torch_dispatch_stack() == 0
    finally:
        strategy.close()
    assert log.steps == 2
    for replica in (0, 1):
        for op, n in PER_STEP.items():
            assert log.count(op=op, device="cpu", replica=replica) == 2 * n, (op, replica)
    assert set(log.summary().operations_per_replica) == {"replica 0", "replica 1", "no replica"}


def test_central_storage_replicas_are_logged():
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    try:
        train = _trainer(strategy)
        with sg.log_placement() as log:
            train([8, 5])
    finally:
        strategy.close()
    assert log.steps == 2
    for replica in (0, 1):
        for op in ("aten::addmm", "aten::threshold_backward", "aten::tanh_backward"):
            assert log.count(op=op, device="cpu", replica=replica) == 2 * PER_STEP[op], (op, replica)


def test_model_parallel_stage_threads_are_logged_for_the_one_replica():
    strategy = sg.ModelParallelStrategy(stages=["cpu:0", "cpu:1"], num_micro_batches=2, registry=cpu_registry(2))
    try:
        train = _trainer(strategy)
        train([8])  # the stage threads exist before the log opens: they must pick it up per run
        with sg.log_placement() as log:
            train([8, 5])
    finally:
        strategy.close()
    assert log.steps == 2
    # Two micro-batches per step, each through the whole MLP: every per-step count doubles.
    for op, n in PER_STEP.items():
        assert log.count(op=op, device="cpu", replica=0) == 2 * 2 * n, op
    assert log.count(replica=1) == 0


def test_empty_log():
    with sg.log_placement() as log:
        pass
    summary = log.summary()
    assert str(summary) == "Placement log: no operations recorded."
    assert summary.num_operations == 0 and summary.steps == 0 and summary.copies_per_step is None
    assert json.loads(json.dumps(summary.to_dict()))["operations_per_device"] == {}


def test_nested_logs_each_see_their_region():
    x = torch.ones(4)
    with sg.log_placement() as outer:
        x.sin()
        with sg.log_placement() as inner:
            x.cos()
        x.tan()
    assert [outer.count(op=f"aten::{f}") for f in ("sin", "cos", "tan")] == [1, 1, 1]
    assert [inner.count(op=f"aten::{f}") for f in ("sin", "cos", "tan")] == [0, 1, 0]
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_captured_log_follows_work_to_another_thread():
    results = {}
    with sg.log_placement() as log:
        captured = capture_placement()

        def work():
            with apply_placement(captured):
                results["stack"] = torch._C._len_torch_dispatch_stack()
                torch.ones(3).exp()

        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=30)
    assert results["stack"] == 1 and log.count(op="aten::exp") == 1
    with apply_placement(None):  # nothing captured: nothing entered
        assert torch._C._len_torch_dispatch_stack() == 0


def test_a_stage_thread_counts_for_the_replica_and_is_judged_against_its_device():
    # A pipeline stage's thread: the work belongs to the caller's replica, its device is the stage's.
    with sg.log_placement() as log:
        previous = enter_replica(ReplicaContext(0, 1, torch.device("cpu"), None))
        try:
            captured = capture_placement()

            def stage():
                with apply_placement(captured, device=torch.device("meta")):
                    torch.ones(2, device="meta").exp()  # on the stage's device
                    torch.ones(2).exp()  # on the CPU: off the stage's device

            thread = threading.Thread(target=stage)
            thread.start()
            thread.join(timeout=30)
        finally:
            enter_replica(previous)
    assert captured.replica == 0
    assert log.count(op="aten::exp", device="meta", replica=0) == 1
    assert log.count(op="aten::exp", device="cpu", replica=0) == 1
    assert log.summary().off_device == [
        OffDeviceOp(op="aten::exp", device="cpu", replica_device="meta", count=1),
        OffDeviceOp(op="aten::ones", device="cpu", replica_device="meta", count=1),
    ]


def test_errors():
    log = sg.log_placement()
    with log:
        pass
    with pytest.raises(InputError, match="already entered. Received: a second `with` on the same log"), log:
        pass
    with pytest.raises(InputError, match=r"at least 1. Received: top=0"):
        log.summary(top=0)
    with pytest.raises(InputError, match=r"takes a torch device name. Received: device='gpu zero'"):
        sg.log_placement(device="gpu zero")
    with pytest.raises(InputError, match=r"takes what capture_placement\(\) returned. Received: str"):
        apply_placement("logs")
    with sg.log_placement():
        captured = capture_placement()
    with pytest.raises(InputError, match=r"apply_placement\(device=\) takes a torch.device. Received: 'cuda:1'"):
        apply_placement(captured, device="cuda:1")


# ---- on a second device (sgdev), in a fresh process (see tests/placement_device.py) ---------------
def _autograd_thread() -> dict:
    # torch runs a non-CPU backward pass on its own device thread; the mode goes with it, and its
    # operations belong to the replica whose backward() started them.
    w = torch.arange(4.0).to("sgdev").requires_grad_()
    backward_threads = []
    w.register_hook(lambda grad: backward_threads.append(threading.current_thread().name))
    with sg.log_placement() as log:
        previous = enter_replica(ReplicaContext(0, 1, torch.device("sgdev:0"), None))
        try:
            loss = (w * w).sum()  # forward: 1 mul, 1 sum
            loss.backward()  # backward: 2 mul (grad * w, twice), 1 add (both paths into w)
            host = w.detach().cpu() * 2  # a mul on the CPU while the replica is on sgdev
        finally:
            enter_replica(previous)
    return {
        "backward_threads": backward_threads,
        "this_thread": threading.current_thread().name,
        "mul": log.count(op="aten::mul", device="sgdev:0", replica=0),
        "add": log.count(op="aten::add", device="sgdev:0", replica=0),
        "no_replica": log.count(replica=None),
        "steps": log.steps,
        "grad": w.grad.cpu(),
        "host": host,
        "summary": log.summary(),
    }


def _copies() -> dict:
    with sg.log_placement() as log:
        for _ in range(2):
            log.step()
            on_device = torch.ones(10, 10).to("sgdev")  # 10 x 10 float32: 400 B to the device
            on_device.cpu()  # and 400 B back
    return {"summary": log.summary()}


def _copy_into_and_item() -> dict:
    source = torch.arange(5, dtype=torch.float64).to("sgdev")
    scalar = torch.tensor(1.5, dtype=torch.float16).to("sgdev")
    with sg.log_placement() as log:
        target = torch.empty(5, dtype=torch.float64)
        target.copy_(source)  # 5 x float64: 40 B
        value = scalar.item()  # one float16 read back: 2 B
    return {"summary": log.summary(), "value": value, "target": target}


def _off_device() -> dict:
    x = torch.ones(3).to("sgdev")
    with sg.log_placement(device="sgdev:0") as log:
        x * 3  # on its device
        for _ in range(2):
            x.cpu() + 1  # a copy (never judged off-device) and an add on the CPU
        x.cpu().neg()
    return {"summary": log.summary(top=1)}


def _text() -> dict:
    with sg.log_placement(device="sgdev:0") as log:
        for _ in range(2):
            log.step()
            torch.ones(10, 10).to("sgdev").cpu().mul(2)  # ones and mul on the CPU, two copies
    return {"summary": log.summary()}


placement_device.register(_autograd_thread, _copies, _copy_into_and_item, _off_device, _text)


@pytest.mark.timeout(120)
def test_autograd_thread_operations_are_attributed_to_the_replica():
    r = placement_device.result(_autograd_thread)
    assert r["backward_threads"] and r["backward_threads"][0] != r["this_thread"]
    assert (r["mul"], r["add"], r["no_replica"], r["steps"]) == (3, 1, 0, 1)
    assert torch.equal(r["grad"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(r["host"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert r["summary"].off_device == [OffDeviceOp(op="aten::mul", device="cpu", replica_device="sgdev:0", count=1)]


@pytest.mark.timeout(120)
def test_copies_are_counted_per_step_with_their_bytes():
    summary = placement_device.result(_copies)["summary"]
    assert summary.steps == 2
    assert summary.num_copies == 4 and summary.copy_bytes == 1600
    assert summary.copies_per_step == 2.0 and summary.bytes_per_step == 800.0
    rows = {(c.source, c.destination): (c.count, c.num_bytes, c.reason) for c in summary.copies}
    assert rows == {("cpu", "sgdev:0"): (2, 800, None), ("sgdev:0", "cpu"): (2, 800, None)}


@pytest.mark.timeout(120)
def test_copy_into_a_tensor_and_item_are_copies():
    r = placement_device.result(_copy_into_and_item)
    assert r["value"] == 1.5 and torch.equal(r["target"], torch.arange(5, dtype=torch.float64))
    rows = [(c.source, c.destination, c.count, c.num_bytes) for c in r["summary"].copies]
    assert rows == [("sgdev:0", "cpu", 2, 42)]


@pytest.mark.timeout(120)
def test_off_device_operations_against_the_logs_device():
    summary = placement_device.result(_off_device)["summary"]
    assert summary.num_off_device == 3 and summary.num_off_device_kinds == 2
    assert summary.off_device == [OffDeviceOp(op="aten::add", device="cpu", replica_device="sgdev:0", count=2)]
    assert "Operations off their replica's device: 3 (top 1)" in str(summary)


@pytest.mark.timeout(120)
def test_summary_text_and_json():
    summary = placement_device.result(_text)["summary"]
    text = str(summary).splitlines()
    assert summary.num_operations == 8  # per step: ones, two _to_copy, mul
    assert text[:5] == [  # no line per replica: no replica ran
        "Placement log: 2 steps, 8 operations",
        "Operations per device: cpu 6, sgdev:0 2",  # the copy back starts on sgdev
        "Copies between devices: 4, 1.56 KiB (2 per step, 800 B per step)",
        "  cpu -> sgdev:0: 2 copies, 800 B",
        "  sgdev:0 -> cpu: 2 copies, 800 B",
    ]
    assert text[5] == "Operations off their replica's device: 4 (all)"
    assert [line.split() for line in text[6:]] == [
        ["aten::mul", "x2", "ran", "on", "cpu", "instead", "of", "sgdev:0"],
        ["aten::ones", "x2", "ran", "on", "cpu", "instead", "of", "sgdev:0"],
    ]
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["steps"] == 2 and data["copies_per_step"] == 2.0 and data["bytes_per_step"] == 800.0
    assert data["off_device"][0] == {
        "op": "aten::mul",
        "device": "cpu",
        "replica_device": "sgdev:0",
        "count": 2,
        "reason": None,
    }
    assert data["copies"][0] == {
        "source": "cpu",
        "destination": "sgdev:0",
        "count": 2,
        "num_bytes": 800,
        "reason": None,
    }
