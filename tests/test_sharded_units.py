"""ShardedStrategy's parts that need no process group: the cut into units, the refusals, the memory formulas."""

from __future__ import annotations

import pytest
import sharded_units_cases
import torch
from helpers import free_port, run_ranks
from torch import nn

import stratagem as sg
from stratagem.cluster import from_torchrun
from stratagem.devices import DeviceRegistry
from stratagem.devices.physical import PhysicalDevice
from stratagem.strategies.records import STRATEGIES
from stratagem.strategies.sharded.checks import (
    check_device,
    check_optimizer,
    check_shards,
    check_stage,
    shard_mismatches,
    shard_records,
)
from stratagem.strategies.sharded.memory import plan_memory, shard_rows
from stratagem.strategies.sharded.optimizer import FOREACH_EXACT, prefer_foreach
from stratagem.strategies.sharded.placement import local_device
from stratagem.strategies.sharded.units import MERGE_UP_TO, cut_model

pytestmark = [pytest.mark.sharded]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)


def test_the_default_cut_makes_each_block_a_unit_and_leaves_the_rest_to_the_root():
    cut = cut_model(Net(), None)
    assert cut.names == ("blocks.0", "blocks.1", "blocks.2")
    # The root's own embed and head (20 + 10 parameters) are gathered with any one block (20).
    assert cut.largest_unit_bytes == (20 + 10 + 20) * 4
    assert cut.model_bytes == (20 + 3 * 20 + 10) * 4
    assert cut.warning() is None
    assert cut.decision().choice.startswith("3 units and the root")


def test_a_sequential_mlp_is_cut_at_its_layers_with_parameters():
    cut = cut_model(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)), None)
    assert cut.names == ("0", "2")


def test_module_classes_or_a_callable_choose_the_units():
    assert cut_model(Net(), (Block,)).names == ("blocks.0", "blocks.1", "blocks.2")
    assert cut_model(Net(), lambda m: isinstance(m, nn.Linear) and m.out_features == 2).names == ("head",)


def test_a_model_with_no_blocks_is_one_unit_and_the_warning_says_the_peak_and_the_cut():
    cut = cut_model(Flat(), None)
    assert cut.whole_model
    message = cut.warning()
    assert message is not None
    assert "the peak working set is the unsharded model (232 B)" in message
    assert "Received: the default found no ModuleList or Sequential of blocks with parameters" in message
    assert "units=(Linear,)" in message


def test_a_policy_of_another_kind_is_refused():
    with pytest.raises(sg.InputError, match=r"units must be None .* Received: units='blocks'"):
        cut_model(Net(), "blocks")  # type: ignore[arg-type]


def test_lbfgs_a_stepped_optimizer_and_a_bad_stage_are_refused():
    model = nn.Linear(2, 1)
    with pytest.raises(sg.InputError, match=r"LBFGS needs every parameter whole .* Received: LBFGS"):
        check_optimizer(torch.optim.LBFGS(model.parameters()))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(sg.InputError, match=r"must not have stepped yet. Received: SGD holding state for 2"):
        check_optimizer(stepped)
    with pytest.raises(sg.InputError, match=r"stage 2 or 3. Received: stage=1"):
        check_stage(1)


def test_cuda_parameters_on_a_gloo_group_are_refused():
    placed = [("fc.weight", torch.device("cuda", 0)), ("fc.bias", torch.device("cuda", 0))]
    with pytest.raises(sg.InputError, match=r"Received: CUDA parameters \(fc.weight, ...\) on a Gloo group"):
        check_device(placed, "gloo")
    check_device(placed, "nccl")


def test_shards_are_ceil_sized_chunks_of_the_first_dimension():
    assert [shard_rows(17, 3, r) for r in range(3)] == [6, 6, 5]
    assert [shard_rows(7, 2, r) for r in range(2)] == [4, 3]
    assert [shard_rows(2, 3, r) for r in range(3)] == [1, 1, 0]


def test_the_plan_of_adamw_over_two_ranks_by_hand():
    model = nn.Linear(10, 5)  # weight 5x10 -> rows 3 and 2; bias 5 -> 3 and 2

    def adamw_plan(**extra):
        params = list(model.parameters())
        return plan_memory(
            params, torch.optim.AdamW(params), rank=1, world_size=2, stage=3, largest_unit_bytes=55 * 4, **extra
        )

    plan = adamw_plan()
    assert plan.parameters == (2 * 10 + 2) * 4
    assert plan.gradients == plan.parameters
    assert plan.optimizer_state == 2 * (2 * 10 + 2) * 4 + 2 * 4  # exp_avg, exp_avg_sq, two step counters
    # current unit, prefetched unit, unsharded gradients and the reduce-scatter input they are copied into
    assert plan.gathered_peak == 4 * 55 * 4
    assert plan.unsharded_model == 55 * 4
    # A data-parallel rank: the whole parameters and gradients, AdamW's two states and its step counters.
    assert plan.replicated == 2 * 55 * 4 + 2 * 55 * 4 + 2 * 4
    assert plan.total == 88 + 88 + 184 + 880
    assert plan.against_replica() == (
        "1.2 KiB per rank against a whole copy's 888 B (1.40x): the state at rest (360 B) is sharded 2 ways, but the "
        "gathered working set (880 B: the largest unit twice, its gradients and their reduce-scatter input) is not "
        "divided by N; smaller units (units=...) lower it"
    )
    stage2 = plan_memory(list(model.parameters()), None, rank=0, world_size=2, stage=2, largest_unit_bytes=55 * 4)
    assert stage2.gathered_peak == 55 * 4 + 2 * 55 * 4 and stage2.optimizer_state == 0
    # The shared-memory file of the units' collectives counts in the total, not in the state at rest.
    shm = adamw_plan(transport_bytes=3 * 1024)
    assert shm.total == plan.total + 3 * 1024
    assert "the state at rest (360 B)" in (shm.against_replica() or "")
    assert "shared-memory transport 3.0 KiB" in str(shm) and "transport" not in str(plan)


def test_the_plan_is_the_peak_of_distribute_or_of_a_step_whichever_is_larger():
    model = nn.Linear(10, 5)  # 220 B; rank 0's padded shards 3 rows: 3 * 10 * 4 + 3 * 4 = 132 B
    params = list(model.parameters())
    kw = dict(rank=1, world_size=2, largest_unit_bytes=55 * 4, allocator="blocks mapped alone")
    stage3 = plan_memory(params, torch.optim.AdamW(params), stage=3, **kw)
    assert stage3.distribute_peak == 220 + 132  # the user's model and its shards, before its whole tensors go
    assert stage3.optimizer_temporaries == 2 * 2 * 10 * 4  # AdamW's denominator: two of the largest shard (2 rows)
    # Stage 3: the shards of the parameters, state and gradients beside the gathered working set.
    assert stage3.training_peak == 88 + 184 + 88 + 880 and stage3.total == stage3.training_peak
    # Stage 2: the whole model gathered when backward starts, before any gradient shard exists.
    stage2 = plan_memory(params, torch.optim.AdamW(params), stage=2, **kw)
    assert stage2.training_peak == 88 + 184 + max(220 + 2 * 220, 88 + 160)
    # Without optimizer state the step's peak can fall below distribute's: the plan is the larger.
    sgd = plan_memory(params, torch.optim.SGD(params, lr=0.1), stage=3, **{**kw, "largest_unit_bytes": 4})
    assert sgd.training_peak == 88 + 0 + 88 + 4 * 4 and sgd.total == sgd.distribute_peak == 352
    assert str(stage3).endswith("peak 1.2 KiB (in distribute 352 B); allocator: blocks mapped alone")
    # An optimizer the plan does not know leaves the total unknown (no refusal is made without it).
    assert plan_memory(params, torch.optim.ASGD(params), stage=3, **kw).total is None


def test_a_whole_model_unit_prefetches_nothing_so_its_peak_is_the_model_and_its_gradients():
    model = nn.Linear(10, 5)
    plan = plan_memory(
        list(model.parameters()), None, rank=0, world_size=2, stage=3, largest_unit_bytes=220, num_units=0
    )
    assert plan.gathered_peak == 220 + 220 + 220
    # bf16 parameters and gradients, a float32 reduce-scatter input: a bf16 unit counts half, the input whole.
    mixed = plan_memory(
        list(model.parameters()),
        None,
        rank=0,
        world_size=2,
        stage=3,
        largest_unit_bytes=220,
        compute_element_size=2,
        reduce_element_size=4,
    )
    assert mixed.gathered_peak == 2 * 110 + 110 + 220


def test_a_rank_whose_shards_differ_from_the_plan_is_named_with_its_shard_and_the_planned_one():
    model = nn.Linear(6, 17)  # 17 rows: 9 on rank 0, 8 on rank 1
    rank0 = [("weight", [17, 6], "float32", [9, 6]), ("bias", [17], "float32", [9])]
    rank1 = [("weight", [17, 6], "float32", [8, 6]), ("bias", [17], "float32", [8])]
    names = ["worker:0", "worker:1"]
    assert shard_records(model.named_parameters()) == [
        ("weight", [17, 6], "float32", [17, 6]),
        ("bias", [17], "float32", [17]),
    ]
    assert shard_mismatches([rank0, rank1], names) == []
    other_dtype = [("weight", [17, 6], "float64", [8, 6]), ("bias", [17], "float64", [8])]
    problems = shard_mismatches([rank0, other_dtype], names)
    assert problems[0] == (
        "worker:1 (rank 1): 'weight' has a shard of (8, 6) float64 (whole (17, 6)), "
        "the plan (8, 6) float32 (whole (17, 6))"
    )
    wider = [("weight", [18, 6], "float32", [9, 6]), ("bias", [18], "float32", [9])]
    assert "worker:1 (rank 1): 'weight' has a shard of (9, 6)" in shard_mismatches([rank0, wider], names)[0]
    assert "holds other parameters than rank 0 (bias)" in shard_mismatches([rank0, rank1[:1]], names)[0]
    with pytest.raises(sg.InputError, match=r"Every rank must shard the same model.*Received: worker:1 \(rank 1\)"):
        check_shards([rank0, other_dtype], names)


def _registry_with_gpus(count: int) -> DeviceRegistry:
    cpu = PhysicalDevice(device_type="cpu", name="cpu", core_count=2)
    gpus = [PhysicalDevice(device_type="cuda", index=i, name="H200", total_memory=141 * 2**30) for i in range(count)]
    return DeviceRegistry(physical=[cpu, *gpus])


def _torchrun_env(local_rank: int, local_world_size: int) -> dict[str, str]:
    return {
        "RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_local_rank_of_a_sharded_job_takes_its_own_gpu(local_rank, monkeypatch):
    env = _torchrun_env(local_rank, 4)
    device, decision = local_device(from_torchrun(env), env, _registry_with_gpus(4))
    assert device == f"cuda:{local_rank}"
    assert f"local rank {local_rank} of 4" in decision.reason
    # The record `stratagem train --strategy sharded` builds from reads the same from the environment.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    devices, _ = STRATEGIES["sharded"].default_devices("sharded", _registry_with_gpus(4))
    assert devices == [f"cuda:{local_rank}"]


def test_a_sharded_process_alone_takes_the_first_gpu_and_without_one_the_cpu():
    env = _torchrun_env(0, 1)
    device, decision = local_device(from_torchrun(env), env, _registry_with_gpus(2))
    assert device == "cuda:0" and "one device per sharded worker process: the first" in decision.reason
    assert local_device(from_torchrun(env), env, _registry_with_gpus(0))[0] == "cpu"


class Tower(nn.Module):
    def __init__(self, widths: list[int], device: str = "cpu") -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, device=device)
        self.blocks = nn.ModuleList([nn.Linear(w, w, bias=False, device=device) for w in widths])


def test_stage_2_merges_consecutive_blocks_while_a_unit_stays_within_the_limit_and_a_larger_block_stays_alone():
    # Blocks of 4x4, 4x4, 4x4, 8x8, 4x4, 4x4 float32 weights: 64, 64, 64, 256, 64, 64 bytes; limit 150 bytes.
    model = Tower([4, 4, 4, 8, 4, 4])
    cut = cut_model(model, None, stage=2, merge_up_to=150)
    assert cut.names == ("blocks.0-1", "blocks.2", "blocks.3", "blocks.4-5")
    assert [len(g) for g in cut.groups] == [2, 1, 1, 2]
    assert cut.units == tuple(model.blocks)
    # The root keeps the embedding (20 parameters); the largest unit is the 8x8 block alone.
    assert cut.root_bytes == 20 * 4 and cut.largest_unit_bytes == 20 * 4 + 256
    decision = cut.decision()
    assert decision.choice == "4 units and the root (blocks.0-1, blocks.2, blocks.3, ...)"
    assert "consecutive ones merged into units of at most 150 B (stage 2's default: 6 blocks in 4 units)" in (
        decision.reason
    )
    # Stage 3 and a policy the user gave keep one unit per block.
    assert cut_model(model, None, stage=3, merge_up_to=150).names == tuple(f"blocks.{i}" for i in range(6))
    assert cut_model(model, (nn.Linear,), stage=2, merge_up_to=150).names == (
        "embed",
        *(f"blocks.{i}" for i in range(6)),
    )


def test_stage_2_makes_a_model_within_the_limit_one_unit_without_the_whole_model_warning():
    model = Tower([4, 4, 4])
    cut = cut_model(model, None, stage=2)  # 272 bytes: far within 8 MiB
    assert cut.whole_model and cut.units == () and cut.largest_unit_bytes == cut.model_bytes == 272
    assert cut.warning() is None
    assert cut.decision().choice == "the whole model as one unit"
    assert cut.decision().reason.startswith("stage 2's default: the model (272 B) is within 8.00 MiB, so one unit")
    # Just over the limit: cut into blocks again; a model of no blocks over it is one unit with the warning.
    assert cut_model(model, None, stage=2, merge_up_to=271).names == ("blocks.0-2",)
    assert cut_model(Flat(), None, stage=2, merge_up_to=100).warning() is not None


def test_the_default_limit_is_8_mib_of_parameters():
    # Linear(512, 512) in float32 holds 1,050,624 bytes: 7 are within 8 MiB (8,388,608 bytes), 8 are not.
    model = nn.Sequential(*[nn.Linear(512, 512, device="meta") for _ in range(12)])
    cut = cut_model(model, None, stage=2)
    assert cut.names == ("0-6", "7-11")
    assert MERGE_UP_TO == 8 * 2**20


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_merged_units_train_as_one_device_with_one_gather_and_reduce_scatter_each():
    ports = [(free_port(), free_port()) for _ in range(2)]
    outcomes = run_ranks(sharded_units_cases.merged_units_cases, [0, 1], args=(ports,), timeout=220)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        default, given = outcome.value["default"], outcome.value["every Linear"]
        # Trunk blocks of 2.0 MiB in float64: three and two merged; the two heads (side by side) merged; no root
        # parameters. SGD with momentum on batches of 13, 5 and 13 split over 2 ranks, against one device.
        assert "sharding units: 3 units and the root (trunk.0-2, trunk.3-4, heads.0-1)" in default["explain"]
        assert "consecutive ones merged into units of at most 8.00 MiB" in default["explain"]
        assert default["worst"] <= 1e-9, (rank, default["worst"])
        assert default["gathers per step"] == [3, 3, 3], default
        assert default["reduce-scatters per step"] == [3, 3, 3], default
        # The user's units win: every Linear its own unit.
        assert "sharding units: 7 units and the root (trunk.0, trunk.1, trunk.2, ...)" in given["explain"]
        assert given["worst"] <= 1e-9, (rank, given["worst"])
        assert given["gathers per step"] == [7, 7, 7] and given["reduce-scatters per step"] == [7, 7, 7], given
        # Merging changes which collective carries a gradient, not a bit of the sum.
        assert outcome.value["bits differing between the cuts"] == 0


def test_the_plan_counts_the_wider_copy_the_batch_check_rides_in():
    params = list(nn.Linear(10, 5).parameters())
    kw = dict(rank=0, world_size=2, largest_unit_bytes=55 * 4, num_units=2)
    for stage in (2, 3):
        plain = plan_memory(params, torch.optim.SGD(params, lr=0.1), stage=stage, **kw)
        riding = plan_memory(params, torch.optim.SGD(params, lr=0.1), stage=stage, batch_check_copy=True, **kw)
        # The step's first reduce-scatter copies its unit's flat gradients into a wider buffer: one unit more.
        assert riding.gathered_peak - plain.gathered_peak == 55 * 4, stage


def test_the_shards_optimizer_takes_foreach_where_torch_was_left_to_choose():
    params = list(nn.Linear(3, 2).parameters())
    left = torch.optim.AdamW(params)
    assert prefer_foreach(left) and left.param_groups[0]["foreach"] is True
    # The user's own choice stays; so does an optimizer whose foreach step over shards is not its loop's.
    chosen = torch.optim.AdamW(params, foreach=False)
    assert not prefer_foreach(chosen) and chosen.param_groups[0]["foreach"] is False
    rprop = torch.optim.Rprop(params)
    assert not prefer_foreach(rprop) and rprop.param_groups[0]["foreach"] is None

    class MyAdamW(torch.optim.AdamW):
        pass

    assert not prefer_foreach(MyAdamW(params))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_foreach_over_dtensor_shards_is_the_loop_over_plain_tensors_bit_for_bit():
    outcomes = run_ranks(sharded_units_cases.foreach_cases, [0], args=(free_port(),), timeout=100)
    assert outcomes[0].error is None, outcomes[0].error
    differing = outcomes[0].value
    # Every optimizer prefer_foreach changes, in float32 and float64: not one value apart after 4 steps.
    assert set(differing) == {f"{c.__name__} {d}" for c in FOREACH_EXACT for d in ("float32", "float64")}
    assert all(n == 0 for n in differing.values()), differing
