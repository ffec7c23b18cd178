"""The data axis's weighted sum (`tensor_parallel/data_axis.DataAxisSum`) refuses a gradient it summed once and that
was accumulated into again: a second backward before zero_grad() would be summed twice.

In a child process of one Gloo worker on 127.0.0.1 (a process group in this one would outlive the test)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from stratagem.errors import InputError
    from stratagem.strategies.tensor_parallel.data_axis import DataAxisSum

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    layer = nn.Linear(3, 2)
    DataAxisSum(list(layer.parameters()), dist.group.WORLD, weight=lambda: 0.5)
    x = torch.ones(4, 3)
    layer(x).sum().backward()
    once = layer.weight.grad.clone()
    assert torch.equal(once, torch.full((2, 3), 2.0)), once  # 4 rows of ones, weighted by 0.5, summed over one worker
    layer.zero_grad()
    layer(x).sum().backward()  # a new gradient tensor after zero_grad(): summed as the first
    try:
        layer(x).sum().backward()  # accumulated into the one summed already
    except InputError as error:
        print("REFUSED", error)
    dist.destroy_process_group()
    """
)


def test_a_gradient_accumulated_into_after_its_sum_is_refused_by_name_not_by_an_ambiguous_tensor_comparison():
    # Before: the summed gradients were a WeakSet, whose `in` compares tensors with == and raised "Boolean value of
    # Tensor with more than one value is ambiguous" instead of the refusal.
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(free_port())], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED A gradient the data axis had summed was accumulated into again" in result.stdout, result.stdout
    assert "zero_grad(set_to_none=False)" in result.stdout
