"""ModelParallelStrategy: one model split across devices, micro-batches pipelined through the stages (GPipe).

Equivalence against the plain one-device loop of tests/cases.py; where each stage's parameters live and
which thread computes them; that the stages really overlap (checked with barriers that only open when two
stages work at the same time, never with timings); the stage map of explain(); every error path.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from cases import (
    OPTIMIZERS,
    TOL,
    assert_same_state,
    build,
    make_batches,
    train_reference,
    train_with,
)
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry, LogicalDeviceConfiguration, PhysicalDevice
from stratagem.strategies.model_parallel.pipeline import balanced_split_points


def strategy_of(num_stages: int, **kwargs) -> sg.ModelParallelStrategy:
    return sg.ModelParallelStrategy([f"cpu:{i}" for i in range(num_stages)], registry=cpu_registry(3), **kwargs)


def assert_same_optimizer_state(ref_opt, opt, dtype):
    got = opt.state_dict()["state"]
    for index, entries in ref_opt.state_dict()["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch.testing.assert_close(got[index][name], value, **TOL[dtype])


# ---- equivalence with one device -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_micro_batches", [1, 3, 5])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_matches_one_device(num_stages, num_micro_batches, opt_name, dtype):
    """Batches of 12, 11, 7, 2, 5: micro-batches of uneven sizes, and batches smaller than the micro-batch count."""
    reference, ref_opt, shape = build("mlp", opt_name, dtype)
    model, opt, _ = build("mlp", opt_name, dtype)
    batches = make_batches(shape, dtype)
    train_reference(reference, ref_opt, batches)

    strategy = strategy_of(num_stages, num_micro_batches=num_micro_batches)
    model, opt, _ = train_with(strategy, model, opt, batches)
    strategy.close()

    assert_same_state(reference, model, dtype)
    assert_same_optimizer_state(ref_opt, opt, dtype)


def test_module_is_the_pipeline_with_the_sequentials_layers_and_a_ddp_style_step_matches_one_device():
    """A step written for DDP (`model.module` in it) runs unchanged: `.module` is what runs the stages, with the
    nn.Sequential's own layers and names, as DDP's `.module` is the model it wraps (issue 27, item 1)."""
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    net, opt, _ = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)

    strategy = strategy_of(2, num_micro_batches=3)
    model, opt = strategy.distribute(net, opt)
    assert strategy.distributed_model is model and model.module is not net
    assert list(model.module.state_dict()) == list(model.state_dict()) == list(reference.state_dict())
    assert dict(model.module.named_children()) == dict(net.named_children())  # the same layer objects
    assert [id(p) for p in model.parameters()] == [id(p) for p in net.parameters()]
    assert repr(model).startswith("ModelParallelModel(module=PipelineModel(")

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.module.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for x, y in strategy.distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    strategy.close()
    assert_same_state(reference, model.module, torch.float64)
    assert_same_optimizer_state(ref_opt, opt, torch.float64)
    model.eval()
    assert not model.training and not model.module.training and not net[0].training
    with pytest.raises(sg.InputError, match=r"cannot be moved with \.to\(\)"):
        model.to(torch.float32)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_conv_pipeline_matches_one_device(num_stages):
    """One stage with micro-batches is plain gradient accumulation; three stages cut the conv net."""
    reference, ref_opt, shape = build("conv", "adam", torch.float32)
    model, opt, _ = build("conv", "adam", torch.float32)
    batches = make_batches(shape, torch.float32)
    train_reference(reference, ref_opt, batches)
    strategy = strategy_of(num_stages, num_micro_batches=4)
    model, opt, _ = train_with(strategy, model, opt, batches)
    strategy.close()
    assert_same_state(reference, model, torch.float32)
    assert_same_optimizer_state(ref_opt, opt, torch.float32)


def test_loss_output_and_evaluation_equal_one_device():
    """The loss on the whole output is the full batch's; without grad the model is a plain forward."""
    model, _, shape = build("mlp", "sgd_momentum", torch.float64)
    reference, _, _ = build("mlp", "sgd_momentum", torch.float64)
    strategy = strategy_of(2, num_micro_batches=3)
    model = strategy.distribute(model)
    for x, y in strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=[7, 2])):
        loss = strategy.run(lambda a, b: F.cross_entropy(model(a), b), args=(x, y))
        torch.testing.assert_close(
            strategy.reduce("mean", loss), F.cross_entropy(reference(x), y), rtol=1e-12, atol=1e-12
        )
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=1e-12, atol=1e-12)
    strategy.close()


def test_batchnorm_with_one_micro_batch_matches_one_device_running_statistics_included():
    def net():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).double()

    batches = make_batches((6,), torch.float64, sizes=[12, 7, 5])
    reference = net()
    train_reference(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches)
    model = net()
    strategy = strategy_of(2)
    model, _, _ = train_with(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches)
    strategy.close()
    assert_same_state(reference, model, torch.float64)  # running_mean, running_var, num_batches_tracked too


class EncoderHead(nn.Module):
    """Not an nn.Sequential: a residual connection, and a parameter of the model itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.head(torch.relu(h) * self.scale + h)


def encoder_head() -> EncoderHead:
    torch.manual_seed(5)
    return EncoderHead().double()


def test_placement_of_named_modules_matches_one_device():
    batches = make_batches((6,), torch.float64)
    reference = encoder_head()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    train_reference(reference, ref_opt, batches)

    net = encoder_head()
    strategy = sg.ModelParallelStrategy(
        placement={"encoder": "cpu:0", "encoder.2": "/cpu:2", "head": "cpu:1"}, registry=cpu_registry(3)
    )
    model, opt, _ = train_with(strategy, net, torch.optim.Adam(net.parameters(), lr=0.01), batches)

    assert model.module is net  # the placed model itself, as DDP's `.module`
    assert_same_state(reference, model, torch.float64)
    assert_same_optimizer_state(ref_opt, opt, torch.float64)
    # The model itself goes on the first device named; a module goes with its longest placed prefix.
    stages = [(s.device, s.modules, s.num_parameters) for s in strategy.stage_map()]
    assert stages == [("cpu:0", ("", "encoder"), 16 + 112), ("cpu:2", ("encoder.2",), 272), ("cpu:1", ("head",), 68)]
    # encoder.2 (inside encoder, on cpu:0) and head (inside the model, on cpu:0) move inputs in and outputs back.
    assert len(net.encoder[2]._forward_pre_hooks) == 1 and len(net.encoder[2]._forward_hooks) == 1
    assert len(net.head._forward_pre_hooks) == 1 and not net.encoder._forward_pre_hooks
    assert strategy.explain().decision("input and output device").choice == "cpu:0"


# ---- where the stages live and run ----------------------------------------------------------------
class Probe(nn.Module):
    """Records the thread that runs each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return x


def test_each_stage_holds_only_its_parameters_and_computes_on_its_own_thread():
    probes = [Probe(), Probe()]
    net = nn.Sequential(
        nn.Linear(6, 16), probes[0], nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), probes[1], nn.Linear(16, 4)
    )
    strategy = strategy_of(2, split_points=[3], num_micro_batches=2)
    model, _ = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    stage0, stage1 = strategy.stage_map()

    assert (stage0.device, stage0.modules, stage0.num_parameters) == ("cpu:0", ("0", "1", "2"), 112)
    assert (stage1.device, stage1.modules, stage1.num_parameters) == ("cpu:1", ("3", "4", "5", "6"), 272 + 68)
    expected0 = {id(p) for p in net[0].parameters()}
    expected1 = {id(p) for i in (3, 6) for p in net[i].parameters()}
    assert {id(p) for p in stage0.parameters} == expected0
    assert {id(p) for p in stage1.parameters} == expected1
    assert {id(p) for p in model.parameters()} == expected0 | expected1  # one copy, split in two

    x, y = make_batches((6,), torch.float32, sizes=[5])[0]
    strategy.run(lambda a, b: F.cross_entropy(model(a), b).backward(), args=(x, y))
    assert probes[0].threads == ["stratagem-stage-0"] * 2  # two micro-batches
    assert probes[1].threads == ["stratagem-stage-1"] * 2
    assert all(p.grad is not None for p in model.parameters())
    strategy.close()


def test_default_split_balances_parameter_counts():
    """Worked out by hand: Linear(6,16) 112, ReLU 0, Linear(16,16) 272, Tanh 0, Linear(16,4) 68."""
    counts = [112, 0, 272, 0, 68]
    assert balanced_split_points(counts, 2) == [2]  # 112 | 340: the largest stage cannot be smaller
    assert balanced_split_points(counts, 3) == [2, 4]  # 112 | 272 | 68
    assert balanced_split_points([10, 0, 10, 0], 2) == [2]  # trailing activations stay with their layer
    assert balanced_split_points([0, 0, 0], 3) == [1, 2]
    assert balanced_split_points([1, 1, 1, 1, 1, 1], 3) == [2, 4]


class Meet(nn.Module):
    """Waits at `barrier` on its `at`-th forward: two of them only get past it if their stages run at once."""

    def __init__(self, barrier: threading.Barrier, at: int) -> None:
        super().__init__()
        self.barrier, self.at, self.calls = barrier, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == self.at:
            self.barrier.wait()
        self.calls += 1
        return x


class _MeetInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner
        if owner.calls == owner.at:
            owner.barrier.wait()
        owner.calls += 1
        return grad, None


class MeetInBackward(Meet):
    """The same, in the backward pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MeetInBackward.apply(x, self)


def _interval(events, phase, stage, micro):
    index = {(e.phase, e.stage, e.micro_batch, e.edge): i for i, e in enumerate(events)}
    return index[(phase, stage, micro, "start")], index[(phase, stage, micro, "end")]


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.timeout(60)
def test_stages_work_on_different_micro_batches_at_the_same_time():
    """Forward: stage 0 on micro-batch 1 while stage 1 is on 0. Backward: stage 0 on 1 while stage 1 is on 0.
    Run one stage after the other and a barrier never opens: the test fails (BrokenBarrierError), it cannot pass by luck."""
    forward, backward = threading.Barrier(2, timeout=20), threading.Barrier(2, timeout=20)
    net = nn.Sequential(
        nn.Linear(4, 8),
        Meet(forward, at=1),
        MeetInBackward(backward, at=0),
        nn.Linear(8, 3),
        Meet(forward, at=0),
        MeetInBackward(backward, at=1),
    )
    strategy = strategy_of(2, split_points=[3], num_micro_batches=2, timeout=40)
    model = strategy.distribute(net)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    strategy.run(lambda a, b: F.cross_entropy(model(a), b).backward(), args=(x, y))

    events = strategy.last_schedule()
    assert len(events) == 2 * 2 * 2 * 2  # (forward, backward) x 2 stages x 2 micro-batches x (start, end)
    assert _overlap(_interval(events, "forward", 0, 1), _interval(events, "forward", 1, 0))
    assert _overlap(_interval(events, "backward", 0, 1), _interval(events, "backward", 1, 0))
    for stage in (0, 1):  # each stage keeps the GPipe order: forwards in order, backwards in reverse
        assert _interval(events, "forward", stage, 0) < _interval(events, "forward", stage, 1)
        assert _interval(events, "backward", stage, 1) < _interval(events, "backward", stage, 0)
    assert max(i for i, e in enumerate(events) if e.phase == "forward") < min(
        i for i, e in enumerate(events) if e.phase == "backward"
    )  # all forwards, then all backwards
    strategy.close()


def test_a_stage_whose_input_gets_no_gradient_does_not_hang_backward():
    class Constant(nn.Module):  # the output ignores the input: nothing flows back to stage 0
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.bias.expand(x.shape[0], 3)

    net = nn.Sequential(nn.Linear(4, 4), Constant())
    strategy = strategy_of(2, num_micro_batches=2, split_points=[1], timeout=20)
    model = strategy.distribute(net)
    strategy.run(lambda x: model(x).sum().backward(), args=(torch.randn(3, 4),))
    assert net[1].bias.grad.tolist() == [3.0, 3.0, 3.0]
    assert net[0].weight.grad is None
    strategy.close()


# ---- explain() ----------------------------------------------------------------------------------
def test_explain_shows_the_stage_map_with_parameters_memory_and_micro_batches():
    strategy = strategy_of(2, num_micro_batches=4)
    before = str(strategy.explain())
    assert "stage 0: cpu:0 (runs on cpu): modules assigned when a model is distributed" in before

    net, opt, _ = build("mlp", "sgd_momentum", torch.float32)
    strategy.distribute(net, opt)
    explanation = strategy.explain()
    text = str(explanation)
    # float32, SGD with momentum: parameters + gradients + one momentum buffer = 3 x 4 bytes per parameter.
    assert (
        "stage 0: cpu:0 (runs on cpu): modules '0', '1'; 112 parameters; 1.31 KiB (parameters 448 B + "
        "gradients 448 B + SGD (1x parameters) state 448 B; activations not counted)"
    ) in text
    assert "stage 1: cpu:1 (runs on cpu): modules '2', '3', '4'; 340 parameters; 3.98 KiB" in text
    assert explanation.num_replicas_in_sync == 1 and strategy.num_replicas_in_sync == 1
    micro = explanation.decision("micro-batches")
    assert micro.choice == "4" and "stage s works on micro-batch m while stage s+1 works on m-1" in micro.reason
    assert explanation.decision("split").reason.endswith("parameters per stage [112, 340]")
    assert explanation.decision("input and output device").choice == "cpu:1"
    assert explanation.to_dict()["details"]["stage 1"].startswith("cpu:1")
    strategy.close()


# ---- errors ---------------------------------------------------------------------------------------
def test_construction_errors_name_the_values_and_the_fix():
    registry = cpu_registry(3)
    with pytest.raises(
        sg.InputError, match=r"exactly one way to split the model. Received: stages=None, placement=None"
    ):
        sg.ModelParallelStrategy(registry=registry)
    with pytest.raises(
        sg.InputError, match=r"exactly one way .* Received: stages=\['cpu:0'\], placement=\{'a': 'cpu:1'\}"
    ):
        sg.ModelParallelStrategy(["cpu:0"], placement={"a": "cpu:1"}, registry=registry)
    with pytest.raises(
        sg.InputError, match=r"num_micro_batches must be a whole number >= 1. Received: num_micro_batches=0"
    ):
        sg.ModelParallelStrategy(["cpu:0"], num_micro_batches=0, registry=registry)
    with pytest.raises(sg.InputError, match=r"Received: num_micro_batches='2'"):
        sg.ModelParallelStrategy(["cpu:0"], num_micro_batches="2", registry=registry)
    with pytest.raises(
        sg.InputError, match=r"timeout must be a finite number of seconds in \(0, 86400\]\. Received: timeout=0"
    ):
        sg.ModelParallelStrategy(["cpu:0"], timeout=0, registry=registry)
    with pytest.raises(sg.InputError, match=r"intra_op_threads must be at least 1. Received: intra_op_threads=0"):
        sg.ModelParallelStrategy(["cpu:0"], intra_op_threads=0, registry=registry)
    with pytest.raises(sg.InputError, match=r"1 whole number\(s\) >= 1 for 2 stages. Received: split_points=\[1, 2\]"):
        sg.ModelParallelStrategy(["cpu:0", "cpu:1"], split_points=[1, 2], registry=registry)
    with pytest.raises(sg.InputError, match=r"in increasing order.* Received: split_points=\[2, 2\]"):
        sg.ModelParallelStrategy(["cpu:0", "cpu:1", "cpu:2"], split_points=[2, 2], registry=registry)
    with pytest.raises(sg.InputError, match=r"Received: split_points=\[0\]"):
        sg.ModelParallelStrategy(["cpu:0", "cpu:1"], split_points=[0], registry=registry)


def test_devices_out_of_range_or_repeated_are_refused_by_the_device_resolution():
    with pytest.raises(sg.DeviceError, match=r"'cpu:5' is out of range: this machine has 3 logical CPU devices"):
        sg.ModelParallelStrategy(["cpu:0", "cpu:5"], registry=cpu_registry(3))
    with pytest.raises(sg.DeviceError, match=r"'cpu:1' and '/cpu:1' both denote the logical device cpu:1"):
        sg.ModelParallelStrategy(["cpu:1", "/cpu:1"], registry=cpu_registry(3))
    with pytest.raises(sg.DeviceError, match=r"'cpu:7' is out of range"):
        sg.ModelParallelStrategy(placement={"encoder": "cpu:7"}, registry=cpu_registry(3))


def _gpu_registry(*configs: LogicalDeviceConfiguration) -> DeviceRegistry:
    """Recorded facts of a one-GPU machine: these checks run on a CPU-only machine too."""
    registry = DeviceRegistry(
        physical=[
            PhysicalDevice(device_type="cpu", core_count=2),
            PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=2**37),
        ]
    )
    registry.set_logical_device_configuration("cuda:0", list(configs))
    return registry


def test_two_stages_on_one_physical_gpu_are_refused():
    registry = _gpu_registry(LogicalDeviceConfiguration(), LogicalDeviceConfiguration())
    with pytest.raises(
        sg.InputError,
        match=r"at most one stage per physical GPU. Received: stages on logical GPUs "
        r"that share cuda:0 \(cuda:0, cuda:1\)",
    ):
        sg.ModelParallelStrategy(["cuda:0", "cuda:1"], registry=registry)


def test_a_stage_too_large_for_its_gpu_is_refused_before_anything_is_copied():
    registry = _gpu_registry(LogicalDeviceConfiguration(memory_limit=1000))
    strategy = sg.ModelParallelStrategy(["cpu:0", "cuda:0"], split_points=[1], registry=registry)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(100, 100))  # stage 1: 10,100 float32 parameters, Adam
    with pytest.raises(
        sg.errors.MemoryEstimateError,
        match=r"Stage 1 on cuda:0 \(modules \['1'\]\) needs at least 157.81 KiB .* the memory limit of "
        r"logical device cuda:0 is 1000 B",
    ):
        strategy.distribute(net, torch.optim.Adam(net.parameters()))
    assert all(p.device.type == "cpu" for p in net.parameters())  # nothing was moved
    assert strategy.stage_map()[1].modules == () and strategy.explain().decision("split") is None  # nor recorded
    assert repr(strategy) == "ModelParallelStrategy(stages=['cpu:0', 'cuda:0'], num_micro_batches=1)"


def test_distribute_errors_name_the_model_and_the_fix():
    with pytest.raises(
        sg.InputError,
        match=r"stages= cuts the layers of an nn.Sequential .* Received: a EncoderHead. "
        r".*placement=",
    ):
        strategy_of(2).distribute(encoder_head())
    with pytest.raises(sg.InputError, match=r"3 stages need at least 3 layers to cut. Received: an nn.Sequential of 2"):
        strategy_of(3).distribute(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(sg.InputError, match=r"layer indices between 1 and 2 .* Received: split_points=\[3\]"):
        strategy_of(2, split_points=[3]).distribute(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    with pytest.raises(
        sg.InputError,
        match=r"BatchNorm layers \['1'\] would normalise each micro-batch with its own "
        r"statistics.* Received: num_micro_batches=2. Use num_micro_batches=1",
    ):
        strategy_of(2, num_micro_batches=2).distribute(
            nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        )
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    with pytest.raises(
        sg.InputError,
        match=r"shared by modules on cpu:0 and cpu:1 \(tied weights\).* Received: "
        r"modules \['1'\] on cpu:1",
    ):
        strategy_of(2).distribute(nn.Sequential(first, second))
    with pytest.raises(sg.InputError, match=r"distribute\(\) needs a torch.nn.Module. Received: str"):
        strategy_of(2).distribute("model")
    strategy = strategy_of(2)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    strategy.distribute(net)
    with pytest.raises(
        sg.InputError,
        match=r"already holds a distributed model; ModelParallelStrategy distributes one model. "
        r"Received: a second distribute\(\) of a Sequential. Make one nn.Module",
    ):
        strategy.distribute(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    strategy.close()


def test_placement_errors_list_the_valid_names():
    registry = cpu_registry(3)
    strategy = sg.ModelParallelStrategy(placement={"encoder": "cpu:0", "decoder": "cpu:1"}, registry=registry)
    with pytest.raises(
        sg.InputError,
        match=r"placement names modules that this EncoderHead does not have: \['decoder'\]. "
        r"Valid names \(as in model.named_modules\(\)\): 'encoder', 'encoder.0', "
        r"'encoder.1', 'encoder.2', 'head'; '' is the model itself",
    ):
        strategy.distribute(encoder_head())
    with pytest.raises(sg.InputError, match=r"no stages to pipeline. Received: num_micro_batches=2 with placement="):
        sg.ModelParallelStrategy(placement={"head": "cpu:1"}, num_micro_batches=2, registry=registry)
    with pytest.raises(
        sg.InputError,
        match=r"split_points cuts the layers of stages=, not a placement. Received: "
        r"split_points=\[1\]",
    ):
        sg.ModelParallelStrategy(placement={"head": "cpu:1"}, split_points=[1], registry=registry)
    with pytest.raises(sg.InputError, match=r"placement must map module names to devices. Received: placement=\{\}"):
        sg.ModelParallelStrategy(placement={}, registry=registry)
    with pytest.raises(
        sg.InputError,
        match=r"with placement= the model runs on the caller's thread. Received: "
        r"intra_op_threads=2 with placement=",
    ):
        sg.ModelParallelStrategy(placement={"head": "cpu:1"}, intra_op_threads=2, registry=registry)
    with pytest.raises(sg.InputError, match=r"Received: placement=\['cpu:0'\]"):
        sg.ModelParallelStrategy(placement=["cpu:0"], registry=registry)


def test_errors_while_running_name_the_stage():
    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("layer exploded")

    strategy = strategy_of(2, num_micro_batches=2, split_points=[1])
    model = strategy.distribute(nn.Sequential(nn.Linear(2, 2), Fails()))
    with pytest.raises(RuntimeError, match="layer exploded") as info:
        strategy.run(lambda x: model(x), args=(torch.randn(4, 2),))
    assert "(raised in stage 1 (cpu:1), forward of micro-batch 0)" in info.value.__notes__

    class Flattens(nn.Module):
        def forward(self, x):
            return x.sum()

    strategy = strategy_of(2, split_points=[1])
    model = strategy.distribute(nn.Sequential(nn.Linear(2, 2), Flattens()))
    with pytest.raises(
        sg.InputError,
        match=r"stage 1 \(cpu:1\) must return one tensor whose first dimension is the "
        r"micro-batch's 4 examples.* Received: a tensor of shape \(\) for micro-batch 0",
    ):
        model(torch.randn(4, 2))
    strategy.close()
    strategy = strategy_of(2, split_points=[1], num_micro_batches=2)
    model = strategy.distribute(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)))
    with pytest.raises(
        sg.InputError,
        match=r"stage 1 \(cpu:1\) changes its input in place.* Received: stage 1 starting "
        r"at layer '1' \(ReLU\). Move the split",
    ):
        model(torch.randn(4, 4))
    with pytest.raises(sg.InputError, match=r"takes one tensor with a batch dimension. Received: a tuple"):
        model((torch.randn(4, 2),))
    with pytest.raises(sg.InputError, match=r"cannot be moved with .to\(\). Received: .to\('cpu'\)"):
        model.to("cpu")
    with pytest.raises(sg.InputError, match=r"run\(\) needs a function to call. Received: int"):
        strategy.run(3)
    strategy.close()


def test_an_error_in_a_stage_backward_is_raised_by_loss_backward():
    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("gradient exploded")

    class Layer(nn.Module):
        def forward(self, x):
            return FailsInBackward.apply(x)

    strategy = strategy_of(2, num_micro_batches=2, split_points=[2], timeout=20)
    model = strategy.distribute(nn.Sequential(nn.Linear(2, 2), Layer(), nn.Linear(2, 2)))
    loss = model(torch.randn(4, 2)).sum()
    with pytest.raises(RuntimeError, match="gradient exploded") as info:
        loss.backward()
    assert any("(raised in stage 0 (cpu:0), backward of micro-batch" in note for note in info.value.__notes__)
    strategy.close()


@pytest.mark.timeout(30)
def test_a_stuck_stage_times_out_with_its_name():
    release = threading.Event()

    class Stuck(nn.Module):
        armed = False

        def forward(self, x):
            if self.armed:
                release.wait(timeout=20)
            return x

    stuck = Stuck()
    strategy = strategy_of(2, split_points=[1], timeout=1.0)
    model = strategy.distribute(nn.Sequential(nn.Linear(2, 2), stuck))
    model(torch.randn(3, 2))  # the stage threads are up: the wait below is for the stuck layer only
    stuck.armed = True
    with pytest.raises(
        sg.CollectiveTimeoutError,
        match=r"Timed out after 1 s waiting for the forward pass: stage 1 "
        r"\(cpu:1\) finished 0 of 1 micro-batches.* raise `timeout=`",
    ):
        model(torch.randn(3, 2))
    release.set()
    strategy.close()
