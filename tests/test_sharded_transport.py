"""ShardedStrategy's all-gathers and reduce-scatters through one host's shared memory (the default), and through
Gloo when shared memory is turned off: both exact against one device, and explain() says which was taken."""

from __future__ import annotations

import pytest
import sharded_transport_cases
import torch
from helpers import free_port, run_ranks

from stratagem.shm import sums

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]


@pytest.mark.skipif(sums.eligible() is not None, reason="shared-memory sums need Linux on x86-64")
@pytest.mark.timeout(240)
def test_shards_cross_workers_through_shared_memory_exactly_and_gloo_when_it_is_off():
    ports = [(free_port(), free_port()) for _ in sharded_transport_cases.CASES]
    outcomes = run_ranks(sharded_transport_cases.transport_cases, [0, 1], args=(ports,), timeout=220)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        shared = got["stage 2 shared memory"]
        assert shared["worst"] <= 1e-9, (rank, shared["worst"])
        assert "all-gather and reduce-scatter: shared memory" in shared["explain"], shared["explain"]
        # Five steps: not one all-gather or reduce-scatter went through Gloo.
        assert shared["calls"] == {
            "all_gather_single": 0,
            "reduce_scatter_single": 0,
            "all_to_all_single": 0,
            "async": 0,
        }, shared
        # The memory plan counts the shared file every rank maps: 2 slots and the result area of 4 MiB each.
        assert shared["plan_transport"] == 3 * (4 << 20), shared["plan_transport"]
        fallback = got["stage 2 gloo"]
        assert fallback["worst"] <= 1e-9, (rank, fallback["worst"])
        explained = fallback["explain"]
        assert "all-gather and reduce-scatter: the process group (gloo) - turned off (shared_memory=False)" in explained
        # Stage 2: one all-gather and one reduce-scatter per unit and step, 5 steps, and this MLP (269 parameters) is
        # one unit at stage 2 (units.MERGE_UP_TO); each reduce-scatter is an all-to-all and a sum (Gloo's own
        # all-reduces).
        # The first reduce-scatter of each step carries the batch check and runs at once; the others end later in
        # backward (reduce_scatter._Deferred): here none, the model being one unit.
        assert fallback["calls"] == {
            "all_gather_single": 5,
            "reduce_scatter_single": 0,
            "all_to_all_single": 5,
            "async": 0,
        }, fallback
        assert fallback["plan_transport"] == 0, fallback["plan_transport"]
        # The rows the all-to-all receives: one more flat gradient buffer of the largest unit, the whole model in
        # float64, in the plan.
        assert fallback["plan_gathered"] - shared["plan_gathered"] == 269 * 8, (fallback, shared)
        # A unit per Linear (3 and the root): each step's reduce-scatters after the first started asynchronously,
        # each one ended while backward went on, every gradient whole when backward returned: exact.
        layered = got["stage 2 gloo, a unit per layer"]
        assert layered["worst"] <= 1e-9, (rank, layered["worst"])
        assert layered["calls"]["all_to_all_single"] == 5 * 3, layered["calls"]
        assert layered["calls"]["async"] == 5 * 2, layered["calls"]


class _CrossWorker:
    """Stands in for `CrossWorker.connect_shared_memory`: the meeting's answer, without processes."""

    def __init__(self, why: str, fell_back: bool) -> None:
        self.answer = (why, fell_back)
        self.shared = None
        self.wanted: list[bool] = []

    def connect_shared_memory(self, *, wanted: bool, why_not: str | None = None) -> tuple[str, bool]:
        self.wanted.append(wanted)
        return self.answer


class _Group:
    def __init__(self, backend: str, cross_worker: _CrossWorker | None = None) -> None:
        self.backend = backend
        self.cross_worker = cross_worker
        self.is_chief = True


def test_shared_memory_true_is_refused_where_the_workers_cannot_share_memory_and_the_fallback_is_said(caplog):
    from stratagem.errors import InputError
    from stratagem.strategies.sharded.transport import connect_transport

    with pytest.raises(InputError, match=r"shared_memory=True moves CPU tensors, .* Received: device=cuda:0"):
        connect_transport(_Group("nccl"), torch.device("cuda:0"), True)
    assert connect_transport(_Group("nccl"), torch.device("cuda:0"), None).choice == "the process group (nccl)"
    two_hosts = _CrossWorker("the workers run on 2 hosts", False)
    with pytest.raises(InputError, match=r"cannot share memory. Received: the workers run on 2 hosts. Leave"):
        connect_transport(_Group("gloo", two_hosts), torch.device("cpu"), True)
    decision = connect_transport(_Group("gloo", two_hosts), torch.device("cpu"), None)
    assert (decision.choice, decision.reason) == ("the process group (gloo)", "the workers run on 2 hosts")
    assert not caplog.records  # several hosts: nothing the user could do
    full = _CrossWorker("/dev/shm has 1 MiB free", True)
    connect_transport(_Group("gloo", full), torch.device("cpu"), None)
    assert "through Gloo's loopback TCP, which is slower than shared memory: /dev/shm has 1 MiB free" in caplog.text
    off = _CrossWorker("turned off (shared_memory=False)", False)
    assert connect_transport(_Group("gloo", off), torch.device("cpu"), False).reason == off.answer[0]
    assert off.wanted == [False]


def test_shared_memory_true_with_one_worker_is_refused_and_frees_the_process_group():
    import torch.distributed as dist

    import stratagem as sg

    with pytest.raises(
        sg.InputError, match=r"shared_memory=True, but the workers cannot share memory. Received: one worker"
    ):
        sg.ShardedStrategy(shared_memory=True, timeout=30)
    assert not dist.is_initialized()


def test_a_backward_defers_its_reduce_scatters_only_when_no_gradient_would_be_read_at_once():
    from stratagem.strategies.sharded.weighting import no_gradient_read_in_backward

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    may_defer = no_gradient_read_in_backward([first, second])
    assert may_defer()
    # FSDP2 adds a unit's output into an existing gradient at once (accumulation, a second loss's backward).
    second.bias.grad = torch.zeros(2)
    assert not may_defer()
    second.bias.grad = None
    # A hook run once a gradient is accumulated reads it at once too.
    handle = first.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert not may_defer()
    handle.remove()
    assert may_defer()
    del first  # a model the user dropped is not kept, and does not count
    assert may_defer()
