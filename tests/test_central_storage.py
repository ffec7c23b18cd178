"""CentralStorageStrategy: parameters and optimizer state once on a central device, replicas compute.

Expected values come from the plain one-device loop of tests/cases.py (or a plain module run by
hand); GPU placements are checked on constructed machines (no CUDA call is made before
`distribute` copies anything), the real GPU paths in tests/gpu/check_strategies.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cases import (
    MODELS,
    OPTIMIZERS,
    TOL,
    assert_same_state,
    build,
    make_batches,
    mlp,
    train_reference,
    train_with,
)
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.cluster import allocator
from stratagem.devices import DeviceRegistry, LogicalDeviceConfiguration, PhysicalDevice
from stratagem.errors import DeviceError, MemoryEstimateError


def central(num_replicas: int, **kwargs) -> sg.CentralStorageStrategy:
    return sg.CentralStorageStrategy([f"cpu:{i}" for i in range(num_replicas)], registry=cpu_registry(3), **kwargs)


def gpu_machine(num_gpus: int, memory_limit: int | None = None) -> DeviceRegistry:
    """A constructed machine with GPUs: placement is decided and checked without any CUDA call."""
    registry = DeviceRegistry(
        physical=[PhysicalDevice(device_type="cpu", core_count=2)]
        + [PhysicalDevice(device_type="cuda", index=i, name="H200", total_memory=2**37) for i in range(num_gpus)]
    )
    if memory_limit is not None:
        registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=memory_limit)])
    return registry


def grad_norm(model) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))


# ---- equivalence with one device -------------------------------------------------------------

# Replicas reading the central parameters in place (logical CPUs), in float64 and float32; replicas with
# their own copy (the GPU path: parameters copied in, gradients reduced onto the central device) in float64
# only, to keep the suite short (float32 rounding is covered by the in-place cases).
CONFIGS = [
    pytest.param(n, True, dtype, id=f"{n}-in-place-{name}")
    for n in (1, 2, 3)
    for dtype, name in ((torch.float64, "f64"), (torch.float32, "f32"))
]
CONFIGS += [pytest.param(n, False, torch.float64, id=f"{n}-copies-f64") for n in (2, 3)]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("num_replicas,share,dtype", CONFIGS)
def test_central_storage_matches_one_device(num_replicas, share, dtype, model_name, opt_name):
    """Uneven splits, a last short batch, a batch smaller than 3 replicas, clipping between backward and step."""
    reference, ref_opt, shape = build(model_name, opt_name, dtype)
    model, opt, _ = build(model_name, opt_name, dtype)
    batches = make_batches(shape, dtype)
    train_reference(reference, ref_opt, batches)

    strategy = central(num_replicas, share_parameters=share)
    dist_model, dist_opt, losses = train_with(strategy, model, opt, batches)
    strategy.close()

    assert_same_state(reference, dist_model.central, dtype)
    assert_same_state(reference, model, dtype)  # the user's own module is the central copy
    got_state, ref_state = dist_opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got_state.keys() == ref_state.keys()
    for index, entries in ref_state.items():
        for name, value in entries.items():
            torch.testing.assert_close(torch.as_tensor(got_state[index][name]), torch.as_tensor(value), **TOL[dtype])
    for (x, y), loss in zip(batches, losses):
        assert torch.isfinite(loss)


@pytest.mark.parametrize("share", [True, False], ids=["in-place", "copies"])
def test_clipping_in_every_replica_scales_the_global_gradient_once(share):
    """Each replica clips what it sees; if a gradient were shared and clipped by every replica, the norm
    after clipping would fall below the one-device norm and the update would differ from one device."""
    max_norm = 0.05
    reference, ref_opt, shape = build("mlp", "sgd_momentum", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=[12, 7, 2])
    ref_norms = []
    for x, y in batches:
        F.cross_entropy(reference(x), y).backward()
        before = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_norms.append((before, grad_norm(reference)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(before > 2 * max_norm for before, _ in ref_norms)  # clipping really engages

    model, opt, _ = build("mlp", "sgd_momentum", torch.float64)
    strategy = central(3, share_parameters=share)
    model, opt = strategy.distribute(model, opt)

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        before = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        after = grad_norm(model)
        opt.step()
        opt.zero_grad()
        return before, after

    for batch, (want_before, want_after) in zip(strategy.distribute_dataset(batches), ref_norms):
        before, after = strategy.run(step, args=batch)
        for got in strategy.experimental_local_results(before):
            torch.testing.assert_close(got, want_before, rtol=1e-9, atol=0)
        for got in strategy.experimental_local_results(after):
            torch.testing.assert_close(got, want_after, rtol=1e-9, atol=0)
    strategy.close()
    assert_same_state(reference, model.central, torch.float64)


def test_lr_scheduler_on_the_returned_optimizer_drives_the_central_update():
    reference, ref_opt, shape = build("mlp", "sgd_momentum", torch.float64)
    model, opt, _ = build("mlp", "sgd_momentum", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=[6, 5, 4])
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for x, y in batches:
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()

    strategy = central(2)
    model, opt = strategy.distribute(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for batch in strategy.distribute_dataset(batches):
        strategy.run(step, args=batch)
        sched.step()
    strategy.close()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert_same_state(reference, model.central, torch.float64)


# ---- storage: once, on the central device ----------------------------------------------------


def test_parameters_and_optimizer_state_exist_once_and_the_update_runs_once_per_step():
    model, user_opt, shape = build("mlp", "adam", torch.float64)
    num_params = len(list(model.parameters()))
    batches = make_batches(shape, torch.float64)
    updates = []
    user_opt.register_step_post_hook(lambda *_: updates.append(1))
    strategy = central(3)
    dist_model, dist_opt, _ = train_with(strategy, model, user_opt, batches)
    strategy.close()

    assert len(updates) == len(batches)  # once per step, not once per replica
    assert dist_opt.optimizer is user_opt and dist_opt.state is user_opt.state
    assert len(user_opt.state) == num_params
    for param, entry in user_opt.state.items():
        assert param.device == strategy.parameter_device == torch.device("cpu")
        assert entry["exp_avg"].shape == param.shape and entry["exp_avg"].device == param.device
    storages = {p.data_ptr() for m in [dist_model.central, *dist_model.replicas] for p in m.parameters()}
    assert len(storages) == num_params  # the three replicas read the central parameters in place

    reference, ref_opt, _ = build("mlp", "adam", torch.float64)
    train_reference(reference, ref_opt, batches)
    plain = OPTIMIZERS["adam"](reference.parameters())
    plain.load_state_dict(dist_opt.state_dict())  # a checkpoint in the plain optimizer's own format
    for a, b in zip(plain.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], **TOL[torch.float64])


@pytest.mark.parametrize("share", [True, False])
def test_the_central_update_takes_every_waiting_replicas_threads_and_hands_them_back(share):
    # While replica 0 applies the update the other replicas wait at the optimizer step, so on the CPU the update
    # runs with every CPU replica's intra-op threads (plain PyTorch's step has the process's); each replica computes
    # with its own share before and after it.
    caller = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        model, user_opt, shape = build("mlp", "sgd_momentum", torch.float64)
        in_update: list[int] = []
        user_opt.register_step_pre_hook(lambda *_: in_update.append(torch.get_num_threads()))
        strategy = central(2, share_parameters=share)
        dist_model, dist_opt = strategy.distribute(model, user_opt)
        computing: list[tuple[int, int]] = []
        for m in dist_model.replicas:
            m.register_forward_pre_hook(
                lambda module, args: computing.append(
                    (sg.current_replica_context().replica_id_in_sync_group, torch.get_num_threads())
                )
            )

        def step(x, y):
            F.cross_entropy(dist_model(x), y).backward()
            dist_opt.step()
            dist_opt.zero_grad()
            dist_model(x)  # after the update, on the same replica thread

        for x, y in strategy.distribute_dataset(make_batches(shape, torch.float64)[:2]):
            strategy.run(step, args=(x, y))
        decision = strategy.explain().decision("optimizer update")
        strategy.close()
    finally:
        torch.set_num_threads(caller)
    assert in_update == [4, 4]
    assert sorted(set(computing)) == [(0, 2), (1, 2)] and len(computing) == 8
    assert "with 4 intra-op threads" in decision.reason


def test_replicas_with_their_own_copy_receive_the_central_parameters_every_step():
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    strategy = central(2, share_parameters=False)
    model, opt = strategy.distribute(model, opt)
    storages = {p.data_ptr() for m in [model.central, *model.replicas] for p in m.parameters()}
    assert len(storages) == 3 * len(list(model.central.parameters()))
    copies = strategy.explain().decision("parameter copies")
    assert copies.choice == "one per step to 2 replica(s)" and "(share_parameters=False)" in copies.reason

    def step_and_report(x, y):
        seen = [p.detach().clone() for p in model.parameters()]  # this replica's copy, before the update
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return seen

    for batch in strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=[5, 4])):
        expected = [p.detach().clone() for p in model.parameters()]  # outside run: the central copy
        seen = strategy.run(step_and_report, args=batch)
        for per_replica, want in zip(seen, expected):
            for got in strategy.experimental_local_results(per_replica):
                torch.testing.assert_close(got, want, rtol=0, atol=0)

    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)  # outside run: into the central copy, handed to the replicas
    for replica in model.replicas:
        assert all(torch.count_nonzero(p) == 0 for p in replica.parameters())
    strategy.close()


@pytest.mark.parametrize("share", [True, False], ids=["in-place", "copies"])
def test_central_copy_keeps_the_buffers_replica_0_computed(share):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    plain = copy.deepcopy(net)
    x = torch.randn(5, 4, dtype=torch.float64)
    # Per-replica statistics, so replica 0's differ from the others' (global statistics: tests/test_batch_norm.py).
    strategy = central(2, share_parameters=share, batch_norm="per_replica")
    model = strategy.distribute(net)
    (batch,) = list(strategy.distribute_dataset([x]))
    strategy.run(lambda piece: model(piece).sum().backward(), args=(batch,))
    strategy.close()
    plain(x[:3])  # replica 0's slice of 5 examples over 2 replicas
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        torch.testing.assert_close(model.state_dict()[name], plain.state_dict()[name], rtol=1e-12, atol=1e-12)


# ---- placement and explain() -----------------------------------------------------------------


def test_explain_on_logical_cpus_says_where_parameters_live_why_and_how_gradients_combine():
    strategy = central(3)
    explanation = strategy.explain()
    storage = explanation.decision("parameter storage")
    assert storage.choice == "once, on cpu"
    assert "3 compute devices (cpu:0, cpu:1, cpu:2)" in storage.reason and "tf.distribute's rule" in storage.reason
    copies = explanation.decision("parameter copies")
    assert copies.choice == "none" and "read its parameters in place (no copy)" in copies.reason
    combination = explanation.decision("gradient combination")
    assert combination.choice == "in-memory, on cpu" and "weighted gradient" in combination.reason
    update = explanation.decision("optimizer update")
    assert update.choice == "once per step, on cpu" and "replica 0 (cpu:0) applies" in update.reason
    text = str(explanation)
    assert text.startswith("CentralStorageStrategy: 3 replica(s) in sync")
    assert "gradient weighting: each replica's gradient weighted by its share of the global batch" in text
    net = mlp()
    strategy.distribute(net)
    # 6*16+16 + 16*16+16 + 16*4+4 = 452 values in the MLP's six tensors
    assert "6 tensors, 452 values, trained once on cpu" in str(strategy.explain())
    strategy.close()


@pytest.mark.skipif(allocator.GLIBC is None or not allocator.READS_TUNABLES, reason="glibc's malloc tunables")
@pytest.mark.parametrize(
    "make", [central, lambda n: sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], registry=cpu_registry(3))]
)
def test_explain_says_how_freed_host_memory_is_treated_where_cpu_replicas_share_a_process(monkeypatch, make):
    monkeypatch.setattr(allocator, "_applied_here", False)  # a `stratagem train` earlier in this process set it
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    memory = make(2).explain().decision("freed host memory")
    assert memory is not None and memory.choice == "returned to the system"
    assert f"start Python with GLIBC_TUNABLES={allocator.KEEP_TUNABLES}" in memory.reason
    monkeypatch.setenv("GLIBC_TUNABLES", allocator.KEEP_TUNABLES)
    kept = make(2).explain().decision("freed host memory")
    assert kept is not None and kept.choice == "kept for reuse"
    assert make(1).explain().decision("freed host memory") is None  # one replica: no other replica waits on its faults


def test_one_gpu_holds_parameters_and_computes():
    strategy = sg.CentralStorageStrategy(registry=gpu_machine(1))
    assert strategy.parameter_device == torch.device("cuda", 0)
    explanation = strategy.explain()
    assert [r.device for r in explanation.replicas] == ["cuda:0"]
    assert explanation.decision("parameter storage").choice == "once, on cuda:0"
    assert "one compute device (cuda:0)" in explanation.decision("parameter storage").reason
    assert explanation.decision("parameter copies").choice == "none"


def test_several_gpus_compute_and_the_cpu_holds_the_parameters():
    strategy = sg.CentralStorageStrategy(registry=gpu_machine(2))
    explanation = strategy.explain()
    assert [r.device for r in explanation.replicas] == ["cuda:0", "cuda:1"]
    assert strategy.parameter_device == torch.device("cpu")
    assert explanation.decision("parameter copies").choice == "one per step to 2 replica(s)"
    assert (
        "replica(s) 0 (cuda:0), 1 (cuda:1) compute on another device than cpu, so they receive a copy of every "
        "parameter at the start of each step"
    ) == explanation.decision("parameter copies").reason
    combination = explanation.decision("gradient combination")
    assert combination.choice == "reduce onto cpu" and "copied back to every replica" in combination.reason


def test_parameter_device_given_explicitly():
    strategy = central(2, parameter_device="/cpu:1")
    assert strategy.explain().decision("parameter storage").reason == "given by parameter_device="
    assert strategy.explain().details["parameter device"] == "cpu:1 (runs on cpu)"
    gpu_central = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cuda:0", registry=gpu_machine(1))
    assert gpu_central.parameter_device == torch.device("cuda", 0)
    assert gpu_central.explain().decision("gradient combination").choice == "reduce onto cuda:0"
    assert gpu_central.explain().decision("parameter copies").choice == "one per step to 2 replica(s)"


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,message",
    [
        (3, r"parameter_device must be one device name. Received: parameter_device=3 \(int\)"),
        (["cpu"], r"parameter_device must be one device name. Received: parameter_device=\['cpu'\] \(list\)"),
        ("tpu:0", r"parameter_device='tpu:0' cannot hold the parameters: .*tpu:0"),
        (
            "cpu:7",
            (
                r"parameter_device='cpu:7' cannot hold the parameters: Device 'cpu:7' is out of range: this machine "
                r"has 3 logical CPU devices"
            ),
        ),
        (
            "cuda:0",
            r"parameter_device='cuda:0' cannot hold the parameters: Device 'cuda:0' is a GPU, but no GPU is visible",
        ),
        (
            "/job:worker/task:1/device:CPU:0",
            (
                r"cannot hold the parameters: Device '/job:worker/task:1/device:CPU:0' "
                r"is on task worker:1"
            ),
        ),
    ],
)
def test_bad_parameter_device_is_refused(value, message):
    with pytest.raises(DeviceError, match=message):
        central(2, parameter_device=value)


def test_bad_share_parameters_and_require_gpu_without_gpu():
    with pytest.raises(sg.InputError, match=r"share_parameters must be True or False. Received: share_parameters='no'"):
        central(2, share_parameters="no")
    with pytest.raises(sg.GpuUnavailableError, match=r"the devices given are not GPUs. Received: devices=\['cpu:0'\]"):
        central(1, require_gpu=True)
    with pytest.raises(sg.GpuUnavailableError, match=r"no GPU can be used, so CentralStorageStrategy would compute on"):
        sg.CentralStorageStrategy(require_gpu=True, registry=cpu_registry(2))


def test_models_too_large_for_a_gpu_are_refused_before_anything_is_copied():
    net = nn.Linear(100, 100)  # 40,400 bytes of parameters, as much for gradients, twice that for Adam's state
    strategy = sg.CentralStorageStrategy(registry=gpu_machine(1, memory_limit=1000))
    with pytest.raises(
        MemoryEstimateError,
        match=r"The central copy \(parameters, gradients and optimizer state\) on "
        r"cuda:0 needs at least 157.81 KiB .* limit of logical device cuda:0 is 1000 B. Keep the "
        r"parameters on the CPU \(parameter_device='cpu'\)",
    ):
        strategy.distribute(net, torch.optim.Adam(net.parameters()))
    compute_only = sg.CentralStorageStrategy(["cuda:0"], parameter_device="cpu", registry=gpu_machine(1, 1000))
    with pytest.raises(
        MemoryEstimateError,
        match=r"A replica's compute copy \(parameters and gradients\) on cuda:0 "
        r"needs at least 78.91 KiB",
    ):
        compute_only.distribute(net, torch.optim.Adam(net.parameters()))
    assert next(net.parameters()).device.type == "cpu"


def test_step_outside_run_with_a_closure_or_in_one_replica_only_is_an_error():
    net = mlp().double()
    strategy = central(2)
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(
        sg.InputError,
        match=r"optimizer.step\(\) ran outside strategy.run\(\).*Received: a call with 2 "
        r"replicas and no step running",
    ):
        opt.step()
    with pytest.raises(
        sg.InputError,
        match=r"a closure that re-evaluates the loss cannot run on every replica. "
        r"Received: closure=",
    ):
        strategy.run(lambda: opt.step(lambda: 0.0))
    x, y = make_batches((6,), torch.float64, sizes=[4])[0]

    def step_in_replica_0_only(a, b):
        F.cross_entropy(model(a), b).backward()
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            opt.step()

    (batch,) = list(strategy.distribute_dataset([(x, y)]))
    with pytest.raises(
        sg.ReplicaError,
        match=r"waiting at the optimizer step of step \d+, but replica 1 \(cpu:1\) "
        r"returned from the step function .* must call optimizer.step\(\)",
    ):
        strategy.run(step_in_replica_0_only, args=batch)
    assert all(p.grad is not None for replica in model.replicas for p in replica.parameters())
    opt.zero_grad()  # outside run: every replica's gradients (and the central ones)
    assert all(p.grad is None for replica in model.replicas for p in replica.parameters())
    with pytest.raises(
        sg.InputError,
        match=r"Parameter groups cannot be added to an optimizer after it was "
        r"distributed. Received: a group with keys \['params'\]",
    ):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(sg.InputError, match="shares parameters with a model this strategy already distributed"):
        strategy.distribute(model.central)
    strategy.close()


def test_one_replica_computing_on_its_own_copy_matches_one_device():
    """The path of one GPU computing with the parameters on the CPU: copy in, gradient out, update centrally."""
    reference, ref_opt, shape = build("conv", "adam", torch.float64)
    model, opt, _ = build("conv", "adam", torch.float64)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)
    strategy = central(1, share_parameters=False)
    dist_model, opt, _ = train_with(strategy, model, opt, batches)
    assert dist_model.replicas[0] is not dist_model.central
    assert strategy.explain().decision("gradient combination").choice == "none (one replica)"
    assert_same_state(reference, dist_model.central, torch.float64)

    # Outside strategy.run, one replica's model and optimizer are the central ones, as on one device.
    ((x, y),) = make_batches(shape, torch.float64, sizes=[6], seed=2)
    F.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    F.cross_entropy(dist_model(x), y).backward()
    opt.step()
    assert_same_state(reference, dist_model.central, torch.float64)


@pytest.mark.parametrize("share", [True, False], ids=["in-place", "copies"])
def test_gradients_accumulated_over_two_runs_then_one_update_match_one_device(share):
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = OPTIMIZERS["sgd_momentum"](reference.parameters())
    first, second = make_batches(shape, torch.float64, sizes=[9, 5])
    (F.cross_entropy(reference(first[0]), first[1]) * 0.5).backward()
    (F.cross_entropy(reference(second[0]), second[1]) * 0.5).backward()
    ref_opt.step()

    strategy = central(3, share_parameters=share)
    dist_model, dist_opt = strategy.distribute(model, opt)
    a, b = list(strategy.distribute_dataset([first, second]))

    def backward_only(x, y):
        (F.cross_entropy(dist_model(x), y) * 0.5).backward()

    strategy.run(backward_only, args=a)
    strategy.run(backward_only, args=b)
    strategy.run(lambda: dist_opt.step())
    strategy.close()
    assert_same_state(reference, dist_model.central, torch.float64)


def test_fit_trains_under_central_storage_like_the_plain_loop():
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    model, opt, _ = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64)
    for _ in range(2):
        train_reference(reference, ref_opt, batches)  # clips at 1.0, as fit(clip_grad_norm=1.0) does
    strategy = central(3)
    history = sg.fit(strategy, model, opt, F.cross_entropy, batches, epochs=2, clip_grad_norm=1.0)
    strategy.close()
    assert len(history.history["loss"]) == 2
    assert_same_state(reference, model, torch.float64)
