"""fit keeps each step's metric state where the strategy reduced it and reads the sums once an epoch,
with accumulate_steps too (each micro-batch's state summed on the device).

On a CPU machine a device read cannot be timed, so the test records it: the strategy's reduce returns
a tensor that notes every way of reading it on the host (.cpu(), .to("cpu"), .item(), int(), float(),
.tolist()). Before, every step copied its state to the CPU (and read its count with int()).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import cpu_registry

import stratagem as sg


class RecordsReads(torch.Tensor):
    reads: list[str] = []
    HOST = {"cpu", "item", "tolist", "__int__", "__float__", "numpy"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in cls.HOST or (name == "to" and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()])):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs)


class Recording(sg.MirroredStrategy):
    def reduce(self, op, value, axis=None):
        return super().reduce(op, value, axis).as_subclass(RecordsReads)


def test_fit_reads_no_step_state_on_the_host():
    RecordsReads.reads = []
    strategy = Recording(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in (5, 4, 3, 6, 2)]
    seen = []

    class Counts(sg.train.Callback):
        def on_train_batch_end(self, context, num_examples):
            seen.append(num_examples)

    try:
        history = sg.fit(
            strategy,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            batches,
            epochs=2,
            callbacks=[Counts()],
        )
    finally:
        strategy.close()
    assert RecordsReads.reads == []
    assert seen == [5, 4, 3, 6, 2] * 2  # the counts come from the batches, not from the device
    assert [log.num_examples for log in history.epochs] == [20, 20]


def test_fit_with_accumulate_steps_reads_no_micro_batch_state_on_the_host():
    RecordsReads.reads = []
    strategy = Recording(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    reference = torch.nn.Linear(3, 2).double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    sizes = (5, 4, 3, 6, 2)
    batches = [
        (torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g)) for n in sizes
    ]
    seen = []

    class Counts(sg.train.Callback):
        def on_train_batch_end(self, context, num_examples):
            seen.append(num_examples)

    try:
        history = sg.fit(
            strategy,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            batches,
            epochs=2,
            accumulate_steps=2,
            callbacks=[Counts()],
        )
    finally:
        strategy.close()
    assert RecordsReads.reads == []  # before: a copy to the CPU after every micro-batch
    assert seen == [9, 9, 2] * 2  # each update's examples, from the batches' sizes
    assert [log.num_examples for log in history.epochs] == [20, 20]
    # One device, each group of two batches trained as one batch of all its examples.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for start in (0, 2, 4):
            group = batches[start : start + 2]
            x, y = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
            F.cross_entropy(reference(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(history.model.state_dict()[key], value, rtol=1e-9, atol=1e-12)
