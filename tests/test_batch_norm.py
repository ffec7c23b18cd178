"""BatchNorm under the in-process strategies: statistics of the global batch by default, forward and
backward, so parameters and running statistics equal one device trained on the same global batches;
per-replica statistics as an option; the user's layers keep their class, keys and eval behaviour."""

from __future__ import annotations

import copy
import io
import re
import time

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, train_reference, train_step
from conftest import cpu_registry
from helpers import WORKERS, launch_workers
from torch import nn

import stratagem as sg
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy

SIZES = [12, 11, 7, 2, 5]  # uneven splits, a batch smaller than 3 replicas, a last short batch


def bn_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.BatchNorm2d(6, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 4),
    )


def bn_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, affine=False, momentum=0.3),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def bn_variants() -> nn.Module:
    """BatchNorm3d, and a layer without running statistics (it uses batch statistics in eval mode too)."""
    return nn.Sequential(
        nn.Conv3d(1, 3, 2),
        nn.BatchNorm3d(3, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 2 * 2 * 2, 8),
        nn.BatchNorm1d(8, track_running_stats=False),
        nn.ReLU(),
        nn.Linear(8, 4),
    )


MODELS = {"conv": (bn_convnet, (2, 8, 8)), "mlp": (bn_mlp, (6,)), "variants": (bn_variants, (1, 3, 3, 3))}


def build(name, dtype=torch.float64):
    factory, shape = MODELS[name]
    torch.manual_seed(42)
    model = factory().to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shape


def batches(shape, sizes=SIZES, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn((n, *shape), generator=g, dtype=dtype) * 2 + 0.5, torch.randint(0, 4, (n,), generator=g))
        for n in sizes
    ]


def train_distributed(strategy, model, optimizer, data):
    model, optimizer = strategy.distribute(model, optimizer)
    step = train_step(model, optimizer)
    for x, y in strategy.distribute_dataset(data):
        strategy.run(step, args=(x, y))
    return model, optimizer


def assert_states_equal(reference, modules, dtype=torch.float64):
    want = reference.state_dict()
    for module in modules:
        got = module.state_dict()
        assert list(got) == list(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, **TOL[dtype], msg=lambda m, k=key: f"{k}: {m}")


def mirrored(n, **kwargs):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], registry=cpu_registry(3), **kwargs)


@pytest.mark.parametrize("model_name", ["conv", "mlp"])
@pytest.mark.parametrize(
    "num_replicas,share",
    [(2, None), (3, None), (2, False), (3, False)],
    ids=["2-shared", "3-shared", "2-copies", "3-copies"],
)
def test_mirrored_with_batch_norm_matches_one_device(model_name, num_replicas, share):
    reference, ref_opt, shape = build(model_name)
    data = batches(shape)
    train_reference(reference, ref_opt, data)
    model, opt, _ = build(model_name)
    strategy = mirrored(num_replicas, share_parameters=share)
    model, opt = train_distributed(strategy, model, opt, data)
    # Every replica: parameters, running_mean, running_var (unbiased global variance), num_batches_tracked.
    assert_states_equal(reference, model.replicas)
    for got in [opt] if share is None else opt._optimizers:  # shared: one state, whole tensors
        for index, entry in ref_opt.state_dict()["state"].items():
            torch.testing.assert_close(
                got.state_dict()["state"][index]["momentum_buffer"], entry["momentum_buffer"], **TOL[torch.float64]
            )
    strategy.close()


def test_float32_and_the_layer_variants_match_one_device():
    for dtype, name in [(torch.float32, "conv"), (torch.float64, "variants")]:
        reference, ref_opt, shape = build(name, dtype)
        data = batches(shape, sizes=[9, 8, 2], dtype=dtype)
        train_reference(reference, ref_opt, data)
        model, opt, _ = build(name, dtype)
        strategy = mirrored(3)
        model, _ = train_distributed(strategy, model, opt, data)
        assert_states_equal(reference, model.replicas, dtype)
        # Without running statistics, eval mode normalises with the statistics of the batch: the global one.
        model.train(False)
        reference.train(False)
        x, _ = batches(shape, sizes=[7], dtype=dtype, seed=5)[0]
        (piece,) = strategy.distribute_dataset([x])
        out = strategy.run(lambda p: model(p), args=(piece,))
        got = torch.cat(strategy.experimental_local_results(out))
        torch.testing.assert_close(got, reference(x), **TOL[dtype])
        strategy.close()


@pytest.mark.parametrize("share", [True, False], ids=["in-place", "copies"])
def test_central_storage_central_copy_gets_the_global_running_statistics(share):
    reference, ref_opt, shape = build("conv")
    data = batches(shape)
    train_reference(reference, ref_opt, data)
    model, opt, _ = build("conv")
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], share_parameters=share, registry=cpu_registry(3))
    model, _ = train_distributed(strategy, model, opt, data)
    assert_states_equal(reference, [model.central])
    # Compute copies receive the parameters at the start of a step; every replica holds the global statistics now.
    for replica in model.replicas:
        for name, value in reference.named_buffers():
            torch.testing.assert_close(replica.get_buffer(name), value, **TOL[torch.float64])
    strategy.close()


def test_evaluate_equals_the_state_dict_loaded_into_a_plain_model():
    model, opt, shape = build("conv")
    data = batches(shape)
    strategy = mirrored(3, share_parameters=False)
    model, _ = train_distributed(strategy, model, opt, data)
    test = batches(shape, sizes=[10, 5], seed=9)
    result = sg.evaluate(strategy, model, test, F.cross_entropy)
    plain = bn_convnet().double()
    plain.load_state_dict(model.state_dict())
    plain.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(plain(x), y, reduction="sum") for x, y in test]
    assert result.metrics["loss"] == pytest.approx(float(sum(losses)) / 15, rel=1e-9)
    for replica in model.replicas[1:]:  # every replica holds the running statistics evaluation reads
        torch.testing.assert_close(replica.state_dict()["1.running_mean"], plain.state_dict()["1.running_mean"])
    strategy.close()


def test_one_example_slices_train_with_global_statistics():
    # 2 examples over 3 replicas: slices of 1, 1 and 0, where per-replica BatchNorm1d raises.
    for name, sizes in [("mlp", [2, 4, 5]), ("conv", [1, 2, 4])]:
        reference, ref_opt, shape = build(name)
        data = batches(shape, sizes=sizes)
        train_reference(reference, ref_opt, data)
        model, opt, _ = build(name)
        strategy = mirrored(3)
        model, _ = train_distributed(strategy, model, opt, data)
        assert_states_equal(reference, model.replicas)
        strategy.close()


def test_one_example_slice_with_per_replica_statistics_is_a_clear_error():
    model, opt, shape = build("mlp")
    strategy = mirrored(3, batch_norm="per_replica")
    with pytest.raises(
        sg.InputError,
        match=r"BatchNorm layer '1' normalises with each replica's own statistics "
        r"\(batch_norm='per_replica'\), but replica [12]'s slice has one value per "
        r"channel\. Received: input of shape \(1, 16\)",
    ):
        train_distributed(strategy, model, opt, batches(shape, sizes=[4]))
    strategy.close()


def test_a_global_batch_of_one_example_fails_as_on_one_device():
    reference, ref_opt, shape = build("mlp")
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        train_reference(reference, ref_opt, batches(shape, sizes=[1]))
    model, opt, _ = build("mlp")
    strategy = mirrored(2)
    with pytest.raises(
        ValueError,
        match=r"Expected more than 1 value per channel when training, got 1 over the global "
        r"batch in BatchNorm layer '1'",
    ):
        train_distributed(strategy, model, opt, batches(shape, sizes=[1]))
    strategy.close()


def test_per_replica_statistics_are_each_replicas_own():
    model, opt, shape = build("mlp")
    strategy = mirrored(2, batch_norm="per_replica")
    ((x, y),) = batches(shape, sizes=[8])
    plain = copy.deepcopy(model)
    model, _ = train_distributed(strategy, model, opt, [(x, y)])
    plain.train()
    with torch.no_grad():
        plain(x[:4])  # replica 0's slice alone
    torch.testing.assert_close(model.state_dict()["1.running_mean"], plain.state_dict()["1.running_mean"])
    first, second = (r.state_dict()["1.running_mean"] for r in model.replicas)
    assert (first - second).abs().max() > 1e-3
    decision = strategy.explain().decision("BatchNorm statistics")
    assert decision.choice == "per replica" and "TensorFlow's default" in decision.reason
    assert "statistics of each replica's own slice, nothing exchanged" in str(strategy.explain())
    strategy.close()


def test_explain_names_the_mode_and_what_each_layer_exchanges():
    strategy = mirrored(2)
    decision = strategy.explain().decision("BatchNorm statistics")
    assert decision.choice == "global batch" and "batch_norm='per_replica' is cheaper" in decision.reason
    model, opt, shape = build("conv")
    strategy.distribute(model)
    text = str(strategy.explain())
    # Layer '1' has 4 channels (9 + 8 values), layer '5' has 6 (13 + 12): (17 + 25) * 8 bytes.
    assert "BatchNorm layers: 2 layer(s)" in text
    assert "336 bytes per step (1: 9 + 8 float64 values; 5: 13 + 12 float64 values)" in text
    assert "BatchNorm meetings" not in text  # nothing measured before a step
    strategy.close()


def test_explain_gives_the_measured_cost_of_the_first_steps_meetings():
    model, opt, shape = build("conv")
    strategy = mirrored(2)
    train_distributed(strategy, model, opt, batches(shape, sizes=[8, 6]))
    text = str(strategy.explain())
    # Two layers, each meeting once in forward and once in backward, in the first step only.
    found = re.search(
        r"BatchNorm meetings: measured in step 1: 4 meetings took ([0-9.]+) ms \(replica 0: ([0-9.]+) ms, "
        r"replica 1: ([0-9.]+) ms\) of the ([0-9.]+) ms from the step's start to its last BatchNorm meeting",
        text,
    )
    assert found is not None, text
    took, r0, r1, span = (float(v) for v in found.groups())
    assert took == max(r0, r1) and 0 < took <= span
    strategy.close()
    assert sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(1)).explain().decision("BatchNorm statistics") is None


def test_the_users_layers_keep_their_class_keys_and_copies():
    model, opt, _ = build("conv")
    keys = list(model.state_dict())
    children = list(model.named_modules())
    strategy = mirrored(2)
    distributed, _ = strategy.distribute(model, opt)
    # The user's model is left as it was: the same modules, of the same classes, with their class's forward.
    assert [(name, id(m)) for name, m in model.named_modules()] == [(name, id(m)) for name, m in children]
    assert type(model[1]) is nn.BatchNorm2d and type(model[5]) is nn.BatchNorm2d
    assert all("forward" not in m.__dict__ for m in model.modules())
    # Replica 0 is a converted copy that trains the user's parameters and buffers themselves.
    assert distributed.replicas[0] is not model and distributed.replicas[0][1] is not model[1]
    assert distributed.replicas[0][1].weight is model[1].weight
    assert distributed.replicas[0][1].running_mean is model[1].running_mean
    for replica in distributed.replicas:
        assert isinstance(replica[1], nn.BatchNorm2d) and list(replica.state_dict()) == keys
    # A copy is no replica: deepcopy and pickle give a layer with its class's forward, which runs on its own.
    twin = copy.deepcopy(distributed.replicas[1])
    buffer = io.BytesIO()
    torch.save(distributed.replicas[0], buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    for copied in (twin, loaded):
        torch.testing.assert_close(copied(x), nn.Sequential(*copied)(x))
    strategy.close()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_replica_that_calls_the_model_once_more_is_named():
    model, opt, shape = build("mlp")
    strategy = mirrored(2, timeout=10)
    model, opt = strategy.distribute(model, opt)

    def step(x, y):
        out = model(x)
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            out = out + model(x)
        else:
            time.sleep(1.0)  # replica 0 waits at its second forward first
        F.cross_entropy(out, y).backward()

    ((x, y),) = strategy.distribute_dataset(batches(shape, sizes=[6]))
    with pytest.raises(
        sg.ReplicaError,
        match=r"Replica 1 \(cpu:1\) reached the BatchNorm statistics of '4' "
        r"\(backward\) of step 1, but replica 0 \(cpu:0\) wait\(s\) at the "
        r"BatchNorm statistics of '1' \(forward\)",
    ):
        strategy.run(step, args=(x, y))
    strategy.close()


def test_a_replica_that_skips_the_model_or_is_late_is_named():
    model, opt, shape = build("mlp")
    strategy = mirrored(2, timeout=0.5)
    model, opt = strategy.distribute(model, opt)
    ((x, y),) = strategy.distribute_dataset(batches(shape, sizes=[6]))

    def skipping(x, y):
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            model(x)

    with pytest.raises(
        sg.ReplicaError,
        match=r"Replica 0 \(cpu:0\) is waiting at the BatchNorm statistics of '1' "
        r"\(forward\) of step 1, but replica 1 \(cpu:1\) returned from the step "
        r"function without getting there\. Every replica must call the model "
        r"\(and backward\(\)\) the same number of times",
    ):
        strategy.run(skipping, args=(x, y))

    def late(x, y):
        if sg.current_replica_context().replica_id_in_sync_group == 1:
            time.sleep(1.0)
        model(x)

    with pytest.raises(
        sg.CollectiveTimeoutError,
        match=r"Timed out after 0.5 s at the BatchNorm statistics of '1' "
        r"\(forward\) of step 2: replica 0 \(cpu:0\) was waiting for "
        r"replica 1 \(cpu:1\)",
    ):
        strategy.run(late, args=(x, y))
    strategy.close()


def test_bad_settings_are_refused():
    with pytest.raises(
        sg.InputError,
        match=r"batch_norm must be one of \('global', 'per_replica'\)\. "
        r"Received: batch_norm='sync'",
    ):
        mirrored(2, batch_norm="sync")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_workers_share_global_statistics_and_idle_workers_take_part(tmp_path):
    """One launch, several checks: 2 workers x 2 replicas, a step in which worker 1's replicas are all idle."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mwms_batch_norm", WORKERS / "mwms_batch_norm.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    exit_code, output = launch_workers(
        "mwms_batch_norm.py",
        {"MW_OUT": str(tmp_path / "out"), "STRATAGEM_DEVICES_PER_WORKER": "2"},
        timeout=200,
        tail=30,
    )
    assert exit_code == 0, output

    reference, ref_opt = worker.build()
    train_reference(reference, ref_opt, worker.batches())
    reference.eval()
    with torch.no_grad():
        test = worker.batches([7, 1], seed=4)
        want_loss = sum(float(F.cross_entropy(reference(x), y, reduction="sum")) for x, y in test) / 8
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        for state in saved["states"]:  # parameters and running statistics of every replica of every worker
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(state[key], value, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}")
        for index, entry in ref_opt.state_dict()["state"].items():
            torch.testing.assert_close(
                saved["optimizer"]["state"][index]["momentum_buffer"], entry["momentum_buffer"], **TOL[torch.float64]
            )
        assert all(0 not in seen for seen in saved["seen"]), saved["seen"]
        assert saved["loss"] == pytest.approx(want_loss, rel=1e-9)
        assert "BatchNorm statistics: global batch" in saved["explain"]
        assert "the last to arrive also sums across workers" in saved["explain"]
    assert saved["seen"][0][1] == 1  # worker 1 ran its stand-in example in the step it had no example of its own


def test_bfloat16_autocast_input_with_float32_parameters():
    # Under autocast BatchNorm gets a bfloat16 input and float32 parameters, which torch's kernels allow.
    model, _, shape = build("conv", torch.float32)
    reference = copy.deepcopy(model)
    ((x, y),) = batches(shape, sizes=[8], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference(x)
    F.cross_entropy(out.float(), y).backward()
    strategy = mirrored(2)
    model = strategy.distribute(model)

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        return out

    ((piece, labels),) = strategy.distribute_dataset([(x, y)])
    outputs = strategy.run(step, args=(piece, labels))
    assert strategy.experimental_local_results(outputs)[0].dtype == torch.bfloat16
    mine = dict(model.replicas[1].named_parameters())
    for name, want in reference.named_parameters():
        if name in ("0.bias", "4.bias"):
            continue  # a bias just before BatchNorm has a gradient of rounding noise only
        got = mine[name].grad
        assert float((got - want.grad).norm() / want.grad.norm()) < 0.05, name  # bfloat16 rounding, not a wrong sum
    torch.testing.assert_close(model.replicas[1][1].running_var, reference[1].running_var, rtol=1e-2, atol=1e-3)
    strategy.close()


class _TwinWorker:
    """The cross-worker part of MultiWorkerMirroredStrategy with one replica per worker, without processes: a
    stand-in for a second worker holding the same slice, so every sum across workers doubles."""

    world_size = 2
    sums_whole_backward = True  # one local replica: no local meeting

    def prepare(self, replicas, replica_params):
        self.params = replica_params[0]

    def begin_step(self, state):
        pass

    def grad_ready(self, index, state):
        pass

    def finish_backward(self, state):
        for p in self.params:  # weighted by this worker's share, summed with the twin's identical gradient
            p.grad.mul_(self.world_size * state.weights[0])

    def after_backward(self, state):
        pass

    def loss_weight_declared(self, count):
        pass

    def loss_weight_total(self, state, num_replicas_in_sync):
        return None

    def batch_norm_sum(self, tensor, what, step):
        return tensor.mul_(2)

    def decisions(self):
        return []

    def details(self):
        return {}


class _TwinWorkers(ReplicatedStrategy):
    def __init__(self) -> None:
        placement = place_replicas(["cpu:0"], require_gpu=False, registry=cpu_registry(1), intra_op_threads=None)
        self._replicas = ReplicaSet(
            self,
            placement,
            build=MirroredReplicas(None),
            across=_TwinWorker(),
            combine=choose_local_combine(placement.devices, nccl_available=False),
            batch_norm="global",
            timeout=60.0,
        )


def test_one_replica_per_worker_sums_across_workers_without_a_local_meeting():
    model, _, shape = build("mlp")
    reference = copy.deepcopy(model)
    ((x, y),) = batches(shape, sizes=[5])
    # One device on the global batch: this worker's slice and the other worker's identical one.
    F.cross_entropy(reference(torch.cat([x, x])), torch.cat([y, y])).backward()
    strategy = _TwinWorkers()
    model = strategy.distribute(model)
    strategy.run(lambda x, y: F.cross_entropy(model(x), y).backward(), args=(x, y))
    # Weighted 1/2 here and summed over the two workers, each gradient is one device's.
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOL[torch.float64], msg=lambda m, k=name: f"{k}: {m}")
    for name, want in reference.named_buffers():  # running_var: the unbiased variance of 10 examples, not 5
        torch.testing.assert_close(model.get_buffer(name), want, **TOL[torch.float64])
    strategy.close()


def test_central_storage_trains_the_users_tensors_and_leaves_its_modules_as_they_were():
    model, opt, shape = build("conv")
    reference, ref_opt, _ = build("conv")
    data = batches(shape)
    train_reference(reference, ref_opt, data, clip=False)
    modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    distributed, dist_opt = strategy.distribute(model, opt)
    assert all("forward" not in m.__dict__ for m in model.modules())  # while the strategy holds the replicas
    step = train_step(distributed, dist_opt, clip=False)
    for batch in strategy.distribute_dataset(data):
        strategy.run(step, args=batch)
    strategy.close()
    assert [(name, id(m), type(m)) for name, m in model.named_modules()] == modules
    assert all("forward" not in m.__dict__ for m in model.modules())
    # The user's own parameters and running statistics are what was trained: one device's.
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, **TOL[torch.float64])
