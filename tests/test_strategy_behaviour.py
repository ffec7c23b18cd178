"""Behaviour of the local strategies beyond equivalence: errors, empty slices, reduce, explain."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.data import split_sizes


def two_replicas(**kwargs) -> sg.MirroredStrategy:
    return sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3), **kwargs)


def test_split_sizes_differ_by_at_most_one_first_replicas_larger():
    assert split_sizes(4, 3) == [2, 1, 1]
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(2, 3) == [1, 1, 0]
    assert split_sizes(9, 3) == [3, 3, 3]


def test_distributed_batch_slices_are_contiguous_views():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    x = torch.arange(4.0).reshape(4, 1)
    (batch,) = list(strategy.distribute_dataset([x]))
    assert [t.flatten().tolist() for t in batch.values] == [[0.0, 1.0], [2.0], [3.0]]
    assert batch.batch_sizes == (2, 1, 1)
    assert batch.values[0].data_ptr() == x.data_ptr()  # a view, no copy


def test_batch_smaller_than_replica_count_trains_without_nan():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    net = nn.Linear(3, 2)
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    (batch,) = list(strategy.distribute_dataset([(x, y)]))
    losses = strategy.run(step, args=batch)
    assert torch.isnan(strategy.experimental_local_results(losses)[2])  # the empty replica's own loss
    assert torch.isfinite(strategy.reduce("mean", losses))  # but it counts for nothing
    for replica in model.replicas:
        assert all(torch.isfinite(p).all() for p in replica.parameters())


def test_reduce_sum_mean_and_axis0_are_worked_out_by_hand():
    strategy = two_replicas()
    values = sg.PerReplica((torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])), batch_sizes=(3, 1))
    assert strategy.reduce("sum", values, axis=0).item() == 10.0
    assert strategy.reduce(sg.ReduceOp.MEAN, values, axis=0).item() == 2.5
    losses = sg.PerReplica((torch.tensor(2.0), torch.tensor(6.0)), batch_sizes=(3, 1))
    assert strategy.reduce("SUM", losses).item() == 8.0
    assert strategy.reduce("mean", losses).item() == 3.0  # (3 * 2 + 1 * 6) / 4
    unweighted = sg.PerReplica((torch.tensor(2.0), torch.tensor(6.0)))
    assert strategy.reduce("mean", unweighted).item() == 4.0
    assert strategy.reduce("sum", torch.tensor(5.0)).item() == 10.0  # a plain value is the same on every replica
    assert strategy.experimental_local_results(losses) == losses.values


def test_reduce_rejects_unknown_op_and_axis():
    strategy = two_replicas()
    with pytest.raises(sg.InputError, match=r"Unknown reduce op. Received: op='max'"):
        strategy.reduce("max", torch.tensor(1.0))
    with pytest.raises(sg.InputError, match=r"axis=None or axis=0. Received: axis=1"):
        strategy.reduce("sum", torch.tensor([1.0]), axis=1)


@pytest.mark.parametrize("bad", [torch.zeros(3, 2), "data.csv", {"x": 1}, 42])
def test_distribute_dataset_rejects_what_is_not_an_iterable_of_batches(bad):
    with pytest.raises(sg.InputError, match=rf"iterable of batches .* Received: {type(bad).__name__}"):
        two_replicas().distribute_dataset(bad)


def test_batch_with_disagreeing_first_dimensions_is_rejected_naming_shapes():
    dataset = two_replicas().distribute_dataset([(torch.zeros(4, 2), torch.zeros(3))])
    with pytest.raises(sg.InputError, match=r"disagree in their first .* \[\(4, 2\), \(3,\)\]"):
        next(iter(dataset))


def test_empty_global_batch_is_rejected():
    dataset = two_replicas().distribute_dataset([torch.zeros(0, 2)])
    with pytest.raises(sg.InputError, match="Batch 0 of the dataset holds no examples"):
        next(iter(dataset))


def test_batch_without_tensors_is_rejected():
    dataset = two_replicas().distribute_dataset([("a", "b")])
    with pytest.raises(sg.InputError, match="at least one tensor"):
        next(iter(dataset))


def test_require_gpu_on_a_cpu_only_machine_raises_with_the_diagnosis():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(sg.GpuUnavailableError, match="require_gpu=True"):
        sg.MirroredStrategy(require_gpu=True)
    with pytest.raises(sg.GpuUnavailableError, match=r"devices given are not GPUs. Received: devices=\['cpu:0'\]"):
        sg.MirroredStrategy(["cpu:0"], require_gpu=True)


def test_no_devices_means_the_cpu_and_explain_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    strategy = sg.MirroredStrategy()
    explanation = strategy.explain()
    assert strategy.num_replicas_in_sync == 1
    decision = explanation.decision("devices")
    assert decision is not None and "cpu:0" in decision.choice
    assert "GPU" in decision.reason or "CPU" in decision.reason
    assert "MirroredStrategy: 1 replica(s) in sync" in str(explanation)


def test_explain_names_the_gradient_combination_and_threads():
    explanation = two_replicas().explain()
    assert explanation.decision("gradient combination").choice == "in-memory"
    assert explanation.decision("intra-op threads per CPU replica") is not None
    assert explanation.to_dict()["replicas"][1]["device"] == "cpu:1"


def test_one_cpu_replica_gets_the_same_thread_rule_and_explain_says_so():
    threads = torch.get_num_threads()
    decision = sg.OneDeviceStrategy("cpu").explain().decision("intra-op threads per CPU replica")
    assert decision.choice == str(threads)
    assert f"the process's {threads} intra-op thread(s) shared among 1 CPU replica(s)" in decision.reason


def test_an_exception_in_one_replica_reaches_the_caller_promptly():
    strategy = two_replicas(timeout=60)
    net = nn.Linear(2, 1)
    model = strategy.distribute(net)

    def step(x):
        if sg.current_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("bad example in replica 1")
        model(x).sum().backward()  # replica 0 now waits for replica 1 at the end of backward

    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad example in replica 1"):
        strategy.run(step, args=(batch,))
    assert time.monotonic() - start < 10  # not the 60 s timeout
    # The strategy still works afterwards.
    strategy.run(lambda x: model(x).sum().backward(), args=(batch,))


def test_a_replica_that_skips_backward_is_named_instead_of_hanging():
    strategy = two_replicas(timeout=60)
    model = strategy.distribute(nn.Linear(2, 1))

    def step(x):
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            model(x).sum().backward()

    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))
    start = time.monotonic()
    with pytest.raises(
        sg.ReplicaError,
        match=r"replica 1 \(cpu:1\) returned from the step function .* must call "
        r"backward\(\)",
    ):
        strategy.run(step, args=(batch,))
    assert time.monotonic() - start < 10


def test_a_stuck_replica_times_out_naming_it():
    strategy = two_replicas(timeout=0.5)
    model = strategy.distribute(nn.Linear(2, 1))
    release = threading.Event()

    def step(x):
        if sg.current_replica_context().replica_id_in_sync_group == 1:
            release.wait(3)
        model(x).sum().backward()

    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))
    with pytest.raises(
        sg.CollectiveTimeoutError,
        match=r"end of backward of step 1: replica 0 \(cpu:0\) was waiting for replica 1 \(cpu:1\)",
    ):
        strategy.run(step, args=(batch,))
    release.set()


def test_backward_outside_run_is_an_error():
    strategy = two_replicas()
    model = strategy.distribute(nn.Linear(2, 1))
    with pytest.raises(sg.InputError, match=r"outside strategy.run\(\)"):
        model(torch.ones(3, 2)).sum().backward()


def test_optimizer_over_other_parameters_is_rejected():
    strategy = two_replicas()
    other = nn.Linear(5, 5)
    with pytest.raises(sg.InputError, match=r"not a parameter of the model .* shape \(5, 5\)"):
        strategy.distribute(nn.Linear(2, 1), torch.optim.SGD(other.parameters(), lr=0.1))


def test_distribute_rejects_non_modules_and_a_model_sharing_parameters_with_one_distributed():
    strategy = two_replicas()
    with pytest.raises(sg.InputError, match=r"needs a torch.nn.Module. Received: str"):
        strategy.distribute("model")
    first = nn.Linear(2, 1)
    strategy.distribute(first)
    strategy.distribute(nn.Linear(2, 1))  # a second model of its own: allowed (a GAN's two models)
    with pytest.raises(sg.InputError, match=r"shares parameters .* 2 shared parameter\(s\), first '0.weight'"):
        strategy.distribute(nn.Sequential(first, nn.ReLU()))


def test_distributed_model_cannot_be_moved():
    model = two_replicas().distribute(nn.Linear(2, 1))
    assert model.to("cpu") is model  # where the replicas already are: nothing to do
    with pytest.raises(sg.InputError, match=r"cannot be moved with .to\(\). Received: .to\(torch.float16\)"):
        model.to(torch.float16)


def test_distributed_model_modules_takes_torchs_arguments():
    # Module.modules(remove_duplicate=...) once raised TypeError on a distributed model.
    shared = nn.Linear(2, 2)
    model = two_replicas().distribute(nn.Sequential(shared, shared))
    replica = model.replicas[0]
    assert list(model.modules(remove_duplicate=False)) == [replica, replica[0], replica[0]]
    assert list(model.modules()) == [replica, replica[0]]


def test_no_grad_in_the_caller_reaches_every_replica():
    strategy = two_replicas()
    model = strategy.distribute(nn.Linear(2, 1))
    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))
    with torch.no_grad():
        out = strategy.run(lambda x: model(x), args=(batch,))
    assert not any(v.requires_grad for v in out.values)


def test_lr_scheduler_changes_reach_every_replica():
    strategy = two_replicas()
    net = nn.Linear(2, 1)
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    (batch,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    strategy.run(step, args=(batch,))
    scheduler.step()
    strategy.run(step, args=(batch,))
    a, b = model.replicas
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt._optimizers[1].param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("share", [True, False])
def test_zero_grad_frees_the_last_steps_gradients(share):
    # Gradients still held by the strategy after zero_grad() would make every backward pass take
    # fresh memory (hundreds of page faults a step on the MLP workload) instead of reusing theirs.
    strategy = two_replicas(share_parameters=share)
    net = nn.Linear(64, 8)
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    batches = list(strategy.distribute_dataset([torch.randn(6, 64) for _ in range(3)]))
    last: dict[int, list[weakref.ref]] = {}
    alive_after_zero_grad = []

    def step(x):
        replica = sg.current_replica_context().replica_id_in_sync_group
        opt.zero_grad()
        alive_after_zero_grad.extend(ref() is not None for ref in last.get(replica, []))
        model(x).square().mean().backward()
        opt.step()
        last[replica] = [weakref.ref(p.grad) for p in model.parameters()]

    for batch in batches:
        strategy.run(step, args=(batch,))
    assert len(alive_after_zero_grad) == 2 * 2 * 2  # two later steps, two replicas, two parameters
    assert not any(alive_after_zero_grad)


def test_per_replica_arguments_must_match_the_replica_count():
    strategy = two_replicas()
    with pytest.raises(sg.InputError, match="has 3 values but this strategy has 2 replicas"):
        strategy.run(lambda x: x, args=(sg.PerReplica((1, 2, 3)),))


def test_distribute_datasets_from_function_gives_each_replica_its_own_batch():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    seen = {}

    def dataset_fn(ctx: sg.InputContext):
        seen["ctx"] = ctx
        per_replica = ctx.get_per_replica_batch_size(4)
        return [torch.full((per_replica, 1), float(i)) for i in range(3)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert seen["ctx"].num_replicas_in_sync == 2 and seen["ctx"].num_input_pipelines == 1
    assert [[v.flatten().tolist() for v in s.values] for s in steps] == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], []]]
    assert steps[1].batch_sizes == (2, 0)


def test_input_context_rejects_indivisible_global_batch():
    ctx = sg.InputContext(num_replicas_in_sync=3)
    with pytest.raises(
        sg.InputError, match=r"global batch size \(8\) is not divisible by the number of replicas in sync \(3\)"
    ):
        ctx.get_per_replica_batch_size(8)


def test_two_replicas_on_one_physical_gpu_are_refused_before_any_work():
    """Recorded facts of a one-GPU machine: the check runs on this CPU-only machine too."""
    from stratagem.devices import DeviceRegistry, LogicalDeviceConfiguration, PhysicalDevice

    registry = DeviceRegistry(
        physical=[
            PhysicalDevice(device_type="cpu", core_count=2),
            PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=2**37),
        ]
    )
    registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(), LogicalDeviceConfiguration()])
    with pytest.raises(
        sg.InputError,
        match=r"at most one replica per physical GPU. Received: several logical GPUs on cuda:0 \(cuda:0, cuda:1\)",
    ):
        sg.MirroredStrategy(["cuda:0", "cuda:1"], registry=registry)


def test_a_model_too_large_for_a_logical_gpu_limit_is_refused_before_anything_is_copied():
    from stratagem.devices import DeviceRegistry, LogicalDeviceConfiguration, PhysicalDevice

    registry = DeviceRegistry(
        physical=[
            PhysicalDevice(device_type="cpu", core_count=2),
            PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=2**37),
        ]
    )
    registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=1000)])
    strategy = sg.MirroredStrategy(["cuda:0"], registry=registry)
    net = nn.Linear(100, 100)  # 10,100 parameters: 40,400 bytes, as much again for gradients, twice for Adam
    with pytest.raises(
        sg.errors.MemoryEstimateError,
        match=r"needs at least 157.81 KiB .* the memory limit of logical device cuda:0 is 1000 B",
    ):
        strategy.distribute(net, torch.optim.Adam(net.parameters()))
    assert next(net.parameters()).device.type == "cpu"  # nothing was moved
