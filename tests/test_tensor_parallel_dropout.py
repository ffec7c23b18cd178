"""A dropout handed a pending sum under TensorParallelStrategy is refused by name, with the fix, at the first forward
(before: DTensor's "Sharding propagation failed for aten.bernoulli_", naming neither the module nor the layout);
and `distribute` itself refuses a layout a model cannot take before it places anything.

In a child process, a cluster of one (a process group in this one would outlive the test): on a mesh of one worker
DTensor still makes the output of a layer split along its input features a `Partial` sum."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

CHILD = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor
    import stratagem as sg
    from stratagem.errors import InputError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Dropout(0.1))
    layouts = sg.LayoutMap()
    layouts[r"^0\\.weight$"] = ("model", None)
    layouts[r"^0\\.bias$"] = ("model",)
    layouts[r"^2\\.weight$"] = (None, "model")  # input features: its output is a pending sum
    strategy = sg.TensorParallelStrategy(layouts)
    # The same layouts over models that cannot take them: refused in distribute, each parameter left as built.
    for other in (nn.Sequential(nn.LayerNorm(4)), nn.Sequential(nn.Embedding(4, 8, sparse=True))):
        try:
            strategy.distribute(other, torch.optim.SGD(other.parameters(), lr=0.1))
        except InputError as error:
            print("DISTRIBUTE REFUSED", error)
        print("LEFT AS BUILT", not any(isinstance(p, DTensor) for p in other.parameters()))
    model, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.full_tensor().clone() for p in model.parameters()]

    def step(x):
        model(x).sum().backward()
        optimizer.step()

    try:
        strategy.run(step, args=(torch.ones(2, 4),))
    except InputError as error:
        print("REFUSED", error)
    print("UNCHANGED", all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters())))
    model.eval()  # no mask drawn in evaluation: nothing to refuse
    with torch.no_grad():
        strategy.run(lambda x: model(x), args=(torch.ones(2, 4),))
    print("EVALUATED")
    strategy.close()
    """
)


@pytest.fixture(scope="module")
def child() -> subprocess.CompletedProcess[str]:
    """One run of CHILD, shared by the tests below."""
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_dropout_on_a_pending_sum_is_refused_naming_the_module_and_evaluation_still_runs(child):
    result = child
    out = result.stdout
    assert "REFUSED The dropout '3' (p=0.1) is handed a pending sum" in out, out + result.stderr[-2000:]
    assert "Build the model with that dropout's p = 0 (GPT-2: resid_pdrop=0)" in out
    assert "UNCHANGED True" in out and "EVALUATED" in out, out


def test_distribute_refuses_a_layout_the_model_cannot_take_before_placing_anything(child):
    # A layout whose length is not its tensor's (a LayerNorm's weight has one dimension); a split an Embedding's
    # forward cannot honour (sparse gradients), naming the module. The strategy then distributes the model it can.
    refused = [line for line in child.stdout.splitlines() if line.startswith("DISTRIBUTE REFUSED")]
    assert len(refused) == 2, child.stdout
    assert "0.weight has 2 entries but the parameter has 1 dimensions" in refused[0], refused[0]
    assert "The Embedding 0 has sparse gradients, which a split table cannot honour" in refused[1], refused[1]
    assert "build it with max_norm=None and sparse=False" in refused[1], refused[1]
    assert child.stdout.count("LEFT AS BUILT True") == 2, child.stdout
