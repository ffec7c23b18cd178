"""strategy.gather: every replica's values in global batch order, under each single-process strategy.

The multi-worker case runs in tests/test_usability_multi_worker.py (one launched job)."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.strategies.parameter_server import InProcessCluster


def mirrored(n: int) -> sg.MirroredStrategy:
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], registry=cpu_registry(3))


STRATEGIES = {
    "one_device": lambda: sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
    "mirrored3": lambda: mirrored(3),
    "central_storage2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "model_parallel": lambda: sg.ModelParallelStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_gather_puts_a_step_s_outputs_back_in_global_batch_order(name):
    strategy = STRATEGIES[name]()
    x = torch.arange(10.0).reshape(10, 1)  # an uneven split over 3 replicas: 4, 3, 3
    y = torch.arange(10)
    labels = [f"ex{i}" for i in range(10)]
    (batch,) = list(strategy.distribute_dataset([(x, y)]))

    def step(x, y):
        return {"doubled": x * 2, "label": y, "count": torch.tensor(x.shape[0])}

    out = strategy.gather(strategy.run(step, args=batch))
    assert out["doubled"].flatten().tolist() == [2.0 * i for i in range(10)]
    assert out["label"].tolist() == list(range(10))
    assert int(out["count"].sum()) == 10 and out["count"].dim() == 1
    assert len(out["count"]) == strategy.num_replicas_in_sync
    # Python objects: each replica's list of strings, joined in order.
    names = strategy.run(lambda y: [labels[i] for i in y.tolist()], args=(batch[1],))
    assert strategy.gather(names) == labels


def test_gather_of_tuples_and_named_tuples_keeps_the_structure_and_axis():
    strategy = mirrored(2)
    Pair = collections.namedtuple("Pair", "logits ids")
    x = torch.arange(12.0).reshape(4, 3)
    (batch,) = list(strategy.distribute_dataset([x]))
    out = strategy.gather(strategy.run(lambda x: Pair(x.T, x[:, :1].long().T), args=(batch,)), axis=1)
    assert isinstance(out, Pair)
    torch.testing.assert_close(out.logits, x.T)
    torch.testing.assert_close(out.ids, torch.tensor([[0, 3, 6, 9]]))


def test_gather_of_plain_objects_gives_one_entry_per_replica_and_a_plain_tensor_once():
    strategy = mirrored(3)
    (batch,) = list(strategy.distribute_dataset([torch.zeros(5, 1)]))
    sizes = strategy.run(lambda x: int(x.shape[0]), args=(batch,))
    assert strategy.gather(sizes) == [2, 2, 1]
    # Lists of the same length on every replica (which run returns as a list of per-replica leaves) join too.
    two = mirrored(2)
    (even,) = list(two.distribute_dataset([torch.arange(4.0)]))
    assert two.gather(two.run(lambda x: [f"ex{int(v)}" for v in x], args=(even,))) == ["ex0", "ex1", "ex2", "ex3"]
    plain = torch.arange(3.0)
    assert torch.equal(strategy.gather(plain), plain)  # this process's own value: counted once


def test_gather_does_not_keep_the_graph():
    strategy = mirrored(2)
    layer = nn.Linear(1, 1)
    model = strategy.distribute(layer)
    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 1)]))
    out = strategy.gather(strategy.run(lambda x: model(x), args=(batch,)))
    assert out.shape == (4, 1) and not out.requires_grad


def test_gather_refuses_mismatched_structures_naming_them():
    strategy = mirrored(2)
    (batch,) = list(strategy.distribute_dataset([torch.zeros(4, 1)]))
    with pytest.raises(sg.InputError, match=r"the same structure.*Received: .*keys \['a'\].*keys \['b'\]"):
        strategy.gather(sg.PerReplica(({"a": torch.zeros(2)}, {"b": torch.zeros(2)})))
    with pytest.raises(sg.InputError, match="axis is out of range.*Received: axis=2"):
        strategy.gather(strategy.run(lambda x: x, args=(batch,)), axis=2)
    with pytest.raises(sg.InputError, match="axis must be an int. Received: axis='0'"):
        strategy.gather(batch, axis="0")
    with pytest.raises(sg.InputError, match="cannot concatenate.*Received: shapes"):
        strategy.gather(sg.PerReplica((torch.zeros(2, 1), torch.zeros(2, 3))))
    with pytest.raises(sg.InputError, match="a tensor from some replicas and another kind"):
        strategy.gather(sg.PerReplica((torch.zeros(2), 3)))
    with pytest.raises(sg.InputError, match="per-replica value with 3 values.*2 local replica"):
        strategy.gather(sg.PerReplica((1, 2, 3)))


def test_gather_inside_a_step_function_is_refused():
    strategy = mirrored(2)
    (batch,) = list(strategy.distribute_dataset([torch.zeros(4, 1)]))
    with pytest.raises(sg.InputError, match="gather combines the values of every replica, so it runs outside"):
        strategy.run(lambda x: strategy.gather(x), args=(batch,))


@pytest.mark.timeout(60)
def test_gather_under_the_parameter_server_is_refused_with_what_to_do():
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = sg.ParameterServerStrategy(cluster)
        with pytest.raises(sg.InputError, match=r"no meaning under ParameterServerStrategy.*coordinator.fetch"):
            strategy.gather(torch.zeros(2))
