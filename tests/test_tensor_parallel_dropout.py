"""A dropout handed a pending sum under TensorParallelStrategy is refused by name, with the fix, at the first forward
(before: DTensor's "Sharding propagation failed for aten.bernoulli_", naming neither the module nor the layout).

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
    import stratagem as sg
    from stratagem.errors import InputError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Dropout(0.1))
    layouts = sg.LayoutMap()
    layouts[r"^0\\.weight$"] = ("model", None)
    layouts[r"^0\\.bias$"] = ("model",)
    layouts[r"^2\\.weight$"] = (None, "model")  # input features: its output is a pending sum
    strategy = sg.TensorParallelStrategy(layouts)
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


def test_a_dropout_on_a_pending_sum_is_refused_naming_the_module_and_evaluation_still_runs():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "REFUSED The dropout '3' (p=0.1) is handed a pending sum" in out, out + result.stderr[-2000:]
    assert "Build the model with that dropout's p = 0 (GPT-2: resid_pdrop=0)" in out
    assert "UNCHANGED True" in out and "EVALUATED" in out, out
