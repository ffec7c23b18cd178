"""`close()` of a strategy with one process per worker hands the chief's rendezvous port back, even while the
trained model (under ShardedStrategy, FSDP2's module state, which keeps the process group) lives on: a new
listener can take the port, a second strategy meets at the same address in the same processes and trains as
plain PyTorch does, and the processes exit cleanly, with no c10d warning or C++ backtrace (issue 25).
Two real processes on 127.0.0.1 under `stratagem launch`."""

from __future__ import annotations

import pytest
import torch
from helpers import launch_json_workers
from workers.close_and_again import batches, model

pytestmark = [pytest.mark.multiprocess]


def _one_device_losses() -> list[float]:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["sharded", "mirrored"])
def test_close_frees_the_chiefs_port_and_a_second_strategy_meets_there_again(kind: str) -> None:
    code, outcomes, lines = launch_json_workers("close_and_again.py", {"CA_KIND": kind}, timeout=200)
    text = "\n".join(lines)
    assert code == 0, text[-4000:]
    assert sorted(outcomes) == [0, 1], text[-4000:]
    assert outcomes[0]["port_free"] is True, outcomes[0]
    expected = _one_device_losses()
    for rank, outcome in outcomes.items():
        first, again = outcome["addresses"]
        assert first == again and first[0] == "127.0.0.1", (rank, outcome["addresses"])
        for losses in outcome["losses"]:  # both strategies train as one device does, from the same start
            assert losses == pytest.approx(expected, rel=1e-5), (rank, outcome["losses"], expected)
    # A store call that fails after a normal end prints "[c10d] ..." with a C++ backtrace ("frame #0: ...").
    for sign in ("[c10d]", "frame #", "terminate called", "Traceback"):
        assert sign not in text, text[-4000:]
