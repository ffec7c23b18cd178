"""Soft placement: an operation registered for the CPU only (torch.library), called on a second
device, runs on the CPU inside `sg.soft_placement()` (forward, backward, in-place, replica
threads), recorded with its copies; without it, a `PlacementError` names the op, the device
and the fix. Expected values are computed with plain torch on the CPU.

The second device is `sgdev` (tests/placement_device.py), whose kernel table really lacks these
operations; its cases run in one fresh process (see there why) and return what the tests check.
"""

from __future__ import annotations

import logging
import threading

import placement_device
import pytest
import torch
from conftest import cpu_registry
from placement_device import cpu_only_ops

import stratagem as sg
from stratagem.diagnose.soft_placement import as_placement_error, missing_kernel
from stratagem.errors import PlacementError

NO_KERNEL = (
    r"Operation sgtest::cube has no kernel for sgdev(:0)? .*Received: inputs on sgdev.*`with sg.soft_placement\(\):`"
)


# ---- cases run on sgdev in a fresh process ---------------------------------------------------------
def _forward() -> dict:
    x = torch.arange(100.0).view(10, 10).to("sgdev")  # 10 x 10 float32: 400 B each way
    with sg.log_placement() as log, sg.soft_placement() as soft:
        y = cpu_only_ops()["cube"](x)
        z = y + 1  # the output is back on sgdev and usable there
    return {
        "device": str(z.device),
        "values": z.cpu(),
        "soft": soft.operations,
        "summary": log.summary(),
        "cube_on_cpu": log.count(op="sgtest::cube", device="cpu"),
    }


def _no_soft_placement() -> dict:
    x = torch.ones(3).to("sgdev")
    errors = {}
    with sg.log_placement():
        try:
            cpu_only_ops()["cube"](x)
        except NotImplementedError as error:
            errors["in a log"] = error
    try:
        cpu_only_ops()["cube"](x)
    except NotImplementedError as error:
        errors["plain"] = error
    return errors


def _backward() -> dict:
    w = torch.tensor([0.5, -1.0, 2.0, 3.0]).to("sgdev").requires_grad_()
    threads = []
    w.register_hook(lambda grad: threads.append(threading.current_thread().name))
    with sg.soft_placement() as soft, sg.log_placement() as log:  # either order works
        cpu_only_ops()["cube"](w).sum().backward()  # backward calls sgtest::square, CPU-only too
    return {
        "grad": w.grad.cpu(),
        "soft": soft.operations,
        "threads": threads,
        "this": threading.current_thread().name,
        "square_on_cpu": log.count(op="sgtest::square", device="cpu"),
    }


def _in_place() -> dict:
    x = torch.tensor([1.0, 2.0, 3.0]).to("sgdev")
    with sg.log_placement() as log, sg.soft_placement():
        cpu_only_ops()["scale_"](x, 2.5)  # mutates x: written back to sgdev
    return {"values": x.cpu(), "device": str(x.device), "summary": log.summary()}


def _mirrored_replicas() -> dict:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    batch = torch.arange(10.0).view(5, 2)  # split 3 + 2
    (piece,) = strategy.distribute_dataset([(batch,)])

    def step(x):
        return cpu_only_ops()["cube"](x.to("sgdev")).cpu().sum()

    try:
        with sg.soft_placement() as soft, sg.log_placement() as log:
            results = strategy.run(step, args=piece)
        try:
            strategy.run(step, args=piece)
            error = None
        except NotImplementedError as raised:  # the pool's translation, no mode anywhere
            error = raised
    finally:
        strategy.close()
    return {
        "results": [r.item() for r in strategy.experimental_local_results(results)],
        "soft": soft.count(),
        "per_replica": [log.count(op="sgtest::cube", device="cpu", replica=r) for r in (0, 1)],
        "error": error,
    }


def _warning_once() -> dict:
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("stratagem.diagnose.soft_placement")
    logger.addHandler(handler)
    try:
        x = torch.ones(2).to("sgdev")
        with sg.soft_placement() as soft:
            for _ in range(3):
                cpu_only_ops()["cube"](x)
    finally:
        logger.removeHandler(handler)
    return {"messages": messages, "count": soft.count("sgtest::cube", "sgdev:0")}


placement_device.register(_forward, _no_soft_placement, _backward, _in_place, _mirrored_replicas, _warning_once)


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_soft_placed_op_runs_on_the_cpu_with_its_copies_recorded():
    r = placement_device.result(_forward)
    expected = torch.arange(100.0).view(10, 10) ** 3 + 1
    assert r["device"] == "sgdev:0" and torch.equal(r["values"], expected)
    assert r["soft"] == {("sgtest::cube", "sgdev:0"): 1} and r["cube_on_cpu"] == 1
    summary = r["summary"]
    rows = {(c.source, c.destination, c.reason): (c.count, c.num_bytes) for c in summary.copies}
    assert rows == {("sgdev:0", "cpu", "soft placement"): (1, 400), ("cpu", "sgdev:0", "soft placement"): (1, 400)}
    [off] = summary.off_device
    assert (off.op, off.device, off.replica_device, off.count) == ("sgtest::cube", "cpu", "sgdev:0", 1)
    assert off.reason == "soft placement: sgtest::cube has no kernel for sgdev:0"
    assert "(soft placement: sgtest::cube has no kernel for sgdev:0)" in str(summary)


@pytest.mark.timeout(180)
def test_without_soft_placement_the_error_names_op_device_and_fix():
    errors = placement_device.result(_no_soft_placement)
    with pytest.raises(PlacementError, match=NO_KERNEL):
        raise errors["in a log"]
    # With no stratagem region at all nothing intercepts the op: torch's own error comes through,
    # and as_placement_error() (what strategy.run's replica pool applies) adds the fix.
    assert not isinstance(errors["plain"], PlacementError)
    with pytest.raises(PlacementError, match=NO_KERNEL):
        raise as_placement_error(errors["plain"])


@pytest.mark.timeout(180)
def test_backward_through_a_soft_placed_op():
    r = placement_device.result(_backward)
    w = torch.tensor([0.5, -1.0, 2.0, 3.0])
    assert torch.equal(r["grad"], 3 * w * w)
    assert r["soft"] == {("sgtest::cube", "sgdev:0"): 1, ("sgtest::square", "sgdev:0"): 1}
    assert r["threads"] and r["threads"][0] != r["this"]  # torch's autograd device thread soft-placed it
    assert r["square_on_cpu"] == 1


@pytest.mark.timeout(180)
def test_an_in_place_op_writes_back():
    r = placement_device.result(_in_place)
    assert r["device"] == "sgdev:0" and torch.equal(r["values"], torch.tensor([2.5, 5.0, 7.5]))
    rows = {(c.source, c.destination): (c.count, c.num_bytes) for c in r["summary"].copies}
    assert rows == {("sgdev:0", "cpu"): (1, 12), ("cpu", "sgdev:0"): (1, 12)}  # 3 float32 there, and written back


@pytest.mark.timeout(180)
def test_soft_placement_reaches_the_replica_threads_and_the_pool_names_the_fix():
    r = placement_device.result(_mirrored_replicas)
    batch = torch.arange(10.0).view(5, 2)
    assert r["results"] == [(batch[:3] ** 3).sum().item(), (batch[3:] ** 3).sum().item()]
    assert r["soft"] == 2 and r["per_replica"] == [1, 1]
    with pytest.raises(PlacementError, match=r"Operation sgtest::cube has no kernel for sgdev.*sg.soft_placement"):
        raise r["error"]
    assert any("(raised in replica" in note for note in r["error"].__notes__)


@pytest.mark.timeout(180)
def test_each_soft_placed_op_is_logged_once_as_a_warning():
    r = placement_device.result(_warning_once)
    assert r["count"] == 3
    assert r["messages"] == [
        "sgtest::cube has no kernel for sgdev:0; it ran on the CPU with its inputs and outputs copied (soft placement)."
    ]


# ---- in this process ---------------------------------------------------------------------------------
def test_an_op_missing_its_cpu_kernel_is_not_soft_placed():
    # Inputs all on the CPU: the CPU is where soft placement would run it, so torch's error stands.
    library = torch.library.Library("sgtest_meta_only", "DEF")  # kept alive while the op is used
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "Meta")
    with sg.soft_placement() as soft, pytest.raises(NotImplementedError, match="from the 'CPU' backend") as raised:
        torch.ops.sgtest_meta_only.twice(torch.ones(2))
    assert not isinstance(raised.value, PlacementError) and soft.count() == 0
    assert missing_kernel(raised.value, [torch.ones(2)]) is None


def test_soft_placement_enters_a_mode_only_inside():
    with sg.soft_placement():
        assert torch._C._len_torch_dispatch_stack() == 1
        with sg.log_placement():  # joins the same mode
            assert torch._C._len_torch_dispatch_stack() == 1
    assert torch._C._len_torch_dispatch_stack() == 0


def test_other_errors_are_not_placement_errors():
    assert as_placement_error(RuntimeError("Could not run 'x::y' with arguments from the 'CUDA' backend")) is None
    assert as_placement_error(NotImplementedError("something else")) is None
    # A missing CPU kernel: soft placement would run it on the CPU, so it is not a placement problem.
    assert (
        as_placement_error(NotImplementedError("Could not run 'x::y' with arguments from the 'CPU' backend.")) is None
    )
    error = as_placement_error(
        NotImplementedError("Could not run 'x::y' with arguments from the 'CUDA' backend. More.")
    )
    assert isinstance(error, PlacementError)
    with pytest.raises(
        PlacementError,
        match=r"Operation x::y has no kernel for CUDA \(torch: Could not run 'x::y' "
        r"with arguments from the 'CUDA' backend.\)",
    ):
        raise error


def test_a_one_device_step_raises_the_placement_error_with_the_fix():
    # One replica runs on the caller's thread, outside the replica pool: it must translate too.
    def step():
        raise NotImplementedError("Could not run 'x::y' with arguments from the 'CUDA' backend. More.")

    with pytest.raises(PlacementError, match=r"Operation x::y has no kernel for CUDA.*sg.soft_placement") as raised:
        sg.OneDeviceStrategy("cpu").run(step)
    assert isinstance(raised.value.__cause__, NotImplementedError)
