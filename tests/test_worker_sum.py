"""The sum across workers after the local combination (collective/worker_sum.py), worked out by hand for one worker
of two: the other worker's contribution is added by a stand-in for the collective, in the same layout."""

from __future__ import annotations

import torch
from torch import nn

from stratagem.collective.worker_sum import sum_gradients_across_workers


class TwoWorkers:
    """This worker's all-reduces, with the other worker's tensors (queued in order) added to ours."""

    world_size = 2

    def __init__(self, *others: torch.Tensor) -> None:
        self.others = list(others)
        self.calls: list[str] = []

    def all_reduce_(self, tensors, *, what, step):
        self.calls.append(what)
        tensors[0].add_(self.others.pop(0))

    def check(self) -> None:
        pass  # a stand-in: no collective of its own to check


def test_only_what_some_worker_reached_is_written_back_and_one_reached_elsewhere_adds_what_this_worker_holds():
    a, b, c, d = (nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (2, 3, 2, 2))
    a.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)  # this worker's local sum (weights 0.5 each side)
    held = torch.tensor([4.0, 8.0, 16.0], dtype=torch.float64)  # combined by an earlier pass, on both workers
    b.grad = held.clone()
    c.grad = torch.tensor([0.1, 0.3], dtype=torch.float64)  # reached by nobody: left bit for bit
    h = torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64)  # what the other worker's pass added to b
    other = torch.cat(
        [
            torch.tensor([10.0, 20.0]),  # a: its local sum
            0.5 * (held + h),  # b: reached there, so its local combination weighed what it held too
            torch.zeros(4),  # c and d: not reached there either
            torch.tensor([1.0, 1.0, 0.0, 0.0]),  # reached: a and b
            torch.tensor([0.0, 0.0]),  # no loss weight declared
        ]
    ).double()
    world = TwoWorkers(other, torch.zeros(3, dtype=torch.float64))  # the correction: the other reached b
    total, declared, extra, combined = sum_gradients_across_workers(world, [[a, b, c, d]], [0], 0.5, (0.0, 0), 3)
    assert combined == [0, 1] and (total, declared, extra) == (0.0, 0, [])
    assert torch.equal(a.grad, torch.tensor([11.0, 22.0], dtype=torch.float64))
    # b: 0.5 * (held + h) from the other worker, plus 0.5 * held from this one in the second all-reduce.
    assert torch.equal(b.grad, held + 0.5 * h)
    assert torch.equal(c.grad, torch.tensor([0.1, 0.3], dtype=torch.float64)) and d.grad is None
    assert world.calls == ["gradient all-reduce", "gradient all-reduce of parameters some workers did not reach"]


def test_a_worker_reached_everywhere_makes_one_all_reduce_and_gives_a_missing_gradient_the_sum():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([1.0, 1.0])
    other = torch.tensor([3.0, 5.0, 7.0, 1.0, 1.0, 2.0, 1.0])  # a, b, reached a and b, a declared weight of 2
    world = TwoWorkers(other)
    replicas = [[a, b], [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))]]
    replicas[1][0].grad = a.grad.clone()
    # b: reached on this worker's other replica only, which filled zeros on the first (the local combination).
    b.grad, replicas[1][1].grad = torch.zeros(1), torch.zeros(1)
    total, declared, _, combined = sum_gradients_across_workers(world, replicas, [0, 1], 1.0, (3.0, 1), 5)
    assert (total, declared, combined) == (5.0, 2, [0, 1]) and world.calls == ["gradient all-reduce"]
    for params in replicas:
        assert torch.equal(params[0].grad, torch.tensor([4.0, 6.0])) and torch.equal(
            params[1].grad, torch.tensor([7.0])
        )
