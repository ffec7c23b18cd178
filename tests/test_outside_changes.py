"""What a script does to a distributed model outside the step reaches every replica, or is refused with the fix
before any replica computes with it (issue 38, item 1; strategies/data_parallel/outside_changes.py).

Before, an attribute set on the model `distribute` returned stayed on the wrapper (the replicas' forward kept
reading the old value: a flag toggled between steps trained something else than one device), and a method
called through it (`model[0].requires_grad_(False)`, `model.apply(init_fn)`) reached replica 0 only."""

from __future__ import annotations

import io

import pytest
import torch
from cases import TOL
from in_process_strategies import STRATEGIES
from outside_change_cases import (
    DTYPE,
    MODEL_CLASSES,
    STEPS,
    FlagNet,
    batches,
    build,
    make_step,
    train_reference,
    train_with,
)
from torch import nn

import stratagem as sg


@pytest.fixture(scope="module")
def reference():
    return train_reference()


def _replicas(model) -> list[nn.Module]:
    return [*getattr(model, "replicas", [model.module]), model.module]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_changes_made_between_steps_train_what_one_device_trains(name, reference):
    expected, frozen_expected = reference
    strategy = STRATEGIES[name]()
    try:
        model, frozen = train_with(strategy)
        torch.testing.assert_close(frozen, frozen_expected, **TOL[DTYPE])
        for replica in _replicas(model):
            assert replica.use_aux is ((STEPS - 1) % 2 == 0)  # the last step's flag, on every copy that runs
            assert not hasattr(replica.head, "scale")
            assert [p.requires_grad for p in replica.body[0].parameters()] == [False, False]
            torch.testing.assert_close(replica.body[0].weight, frozen, rtol=0, atol=0)  # frozen: bit for bit
            got = replica.state_dict()
            assert got.keys() == expected.state_dict().keys()  # the buffer registered after distribute included
            for key, value in expected.state_dict().items():
                torch.testing.assert_close(got[key], value, **TOL[DTYPE], msg=lambda m, k=key: f"{name} {k}: {m}")
    finally:
        strategy.close()


def test_a_flag_set_on_the_distributed_model_reaches_every_replica_before_the_next_step():
    strategy = STRATEGIES["mirrored-3-copies"]()
    try:
        model, optimizer = strategy.distribute(*build())
        model.use_aux = False
        seen = []

        def step(x, y):
            seen.append(model.module.use_aux)
            return model(x).sum()

        (x, y), *_ = strategy.distribute_dataset(batches())
        strategy.run(step, args=(x, y))
        assert seen == [False, False, False]
        assert model.use_aux is False and "use_aux" not in vars(model)  # the module's, not the wrapper's
    finally:
        strategy.close()


def test_a_random_apply_after_distribute_gives_every_replica_replica_0s_draws():
    strategy = STRATEGIES["mirrored-3-copies"]()
    try:
        model, _ = strategy.distribute(*build())
        torch.manual_seed(5)
        model.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
        plain, _ = build()
        torch.manual_seed(5)
        plain.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
        (x, y), *_ = strategy.distribute_dataset(batches())
        strategy.run(lambda x, y: model(x).sum(), args=(x, y))  # the replay happens before this step
        for replica in model.replicas:
            for got, want in zip(replica.parameters(), plain.parameters()):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        strategy.close()


@pytest.mark.parametrize("name", ["one-device", "mirrored-2", "mirrored-3-copies", "central-3"])
def test_the_pickle_of_a_distributed_model_is_the_plain_modules_own(name):
    strategy = STRATEGIES[name]()
    try:
        model, _ = train_with(strategy)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        with torch.serialization.safe_globals(MODEL_CLASSES):  # the model's own classes, nothing of stratagem
            loaded = torch.load(buffer, weights_only=True)
        assert type(loaded) is FlagNet
        plain = io.BytesIO()
        torch.save(model.module, plain)
        assert buffer.getvalue() == plain.getvalue()  # byte for byte the plain module's pickle
        for key, value in model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
        assert isinstance(model, FlagNet) and type(model) is not FlagNet  # as the user's model, still the wrapper
    finally:
        strategy.close()


def _distributed(name: str = "mirrored-3-copies"):
    strategy = STRATEGIES[name]()
    model, optimizer = strategy.distribute(*build())
    return strategy, model, optimizer


def _run_one_step(strategy, model, optimizer):
    (x, y), *_ = strategy.distribute_dataset(batches())
    strategy.run(make_step(model, optimizer), args=(x, y))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_conversion_of_the_distributed_model_is_refused_at_once(name):
    strategy, model, optimizer = _distributed(name)
    try:
        assert model.double() is model  # already float64: nothing changes, nothing refused
        with pytest.raises(sg.InputError, match=r"keeps the dtype and devices.*Convert the model before"):
            model.float()
        assert all(p.dtype == DTYPE for r in _replicas(model) for p in r.parameters())
        _run_one_step(strategy, model, optimizer)
    finally:
        strategy.close()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_conversion_of_a_submodule_is_refused_before_the_next_step_runs(name):
    strategy, model, optimizer = _distributed(name)
    try:
        model.head.float()  # reached through the model: refused at the next run, before any replica computes
        with pytest.raises(sg.InputError, match=r"'head\.weight' .* changed to torch\.float32 .* Received: .*Convert"):
            _run_one_step(strategy, model, optimizer)
        model.head.double()  # undone: the next step runs, every replica on the primary's values
        _run_one_step(strategy, model, optimizer)
    finally:
        strategy.close()


def test_unfreezing_a_parameter_frozen_at_distribute_is_refused():
    strategy = STRATEGIES["mirrored-2"]()
    try:
        net, optimizer = build()
        net.aux.requires_grad_(False)
        model, optimizer = strategy.distribute(net, optimizer)
        model.aux.requires_grad_(True)
        with pytest.raises(sg.InputError, match=r"'aux\.weight' was frozen .* Received: 'aux\.weight'\.requires_grad"):
            _run_one_step(strategy, model, optimizer)
    finally:
        strategy.close()


def test_freezing_then_unfreezing_a_parameter_trainable_at_distribute_is_allowed():
    strategy, model, optimizer = _distributed("mirrored-2")
    try:
        model.aux.requires_grad_(False)
        _run_one_step(strategy, model, optimizer)
        assert all(not p.requires_grad for r in model.replicas for p in r.aux.parameters())
        model.aux.requires_grad_(True)
        _run_one_step(strategy, model, optimizer)
        assert all(p.requires_grad for r in model.replicas for p in r.aux.parameters())
    finally:
        strategy.close()


def test_a_parameter_or_a_submodule_with_parameters_added_through_the_model_is_refused_at_once():
    strategy, model, optimizer = _distributed("mirrored-2")
    try:
        with pytest.raises(sg.InputError, match=r"parameter 'extra' .* was added after .*Build the model"):
            model.extra = nn.Parameter(torch.zeros(3, dtype=DTYPE))
        with pytest.raises(sg.InputError, match=r"submodule 'probe' .* 68 parameter values .*Build the model with it"):
            model.probe = nn.Linear(16, 4).to(DTYPE)
        with pytest.raises(sg.InputError, match=r"parameter 'extra' .* was added"):
            model.register_parameter("extra", nn.Parameter(torch.zeros(3, dtype=DTYPE)))
        assert "extra" not in dict(model.named_parameters()) and not hasattr(model.module, "probe")
        model.act = nn.GELU()  # a submodule without parameters: every replica gets its own copy
        _run_one_step(strategy, model, optimizer)
        assert all(isinstance(r.act, nn.GELU) for r in model.replicas)
        assert model.replicas[0].act is not model.replicas[1].act
    finally:
        strategy.close()


def test_a_parameter_replaced_on_a_submodule_is_refused_before_the_next_step():
    strategy, model, optimizer = _distributed("mirrored-2")
    try:
        model.head.weight = nn.Parameter(torch.zeros(4, 16, dtype=DTYPE))
        with pytest.raises(sg.InputError, match=r"'head\.weight' .* replaced by another tensor after"):
            _run_one_step(strategy, model, optimizer)
    finally:
        strategy.close()


def test_an_attribute_holding_a_function_of_a_submodule_calls_each_replicas_own():
    strategy, model, optimizer = _distributed("mirrored-2")
    try:
        head = model.head
        model.project = lambda h: head(h)  # closes over replica 0's head
        _run_one_step(strategy, model, optimizer)
        h = torch.randn(2, 16, dtype=DTYPE)
        for replica in model.replicas:
            torch.testing.assert_close(replica.project(h), replica.head(h), rtol=0, atol=0)
        assert model.replicas[1].project is not model.replicas[0].project
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_changes_between_steps_reach_every_worker_and_replica_under_the_multi_process_strategies(reference):
    import outside_change_cases
    from helpers import free_port, run_ranks

    expected, frozen_expected = reference
    ports = [free_port() for _ in range(6)]
    outcomes = run_ranks(outside_change_cases.workers_case, [0, 1], args=(ports,), timeout=280)
    errors = {rank: outcome.error for rank, outcome in outcomes.items() if outcome.error is not None}
    assert not errors, errors
    last_flag = (STEPS - 1) % 2 == 0
    for rank, outcome in outcomes.items():
        for case, got in torch.load(io.BytesIO(outcome.value)).items():
            if case == "sharded pickle":
                assert "cannot be saved whole" in got, got  # each rank holds shards: refused, with the fix
                continue
            states = got["replicas"] if "replicas" in got else [got["state"]]
            assert got["flags"] == [(last_flag, False)] * len(states), (rank, case)
            assert got["requires_grad"] == [[False, False]] * len(states), (rank, case)
            torch.testing.assert_close(got["frozen"], frozen_expected, **TOL[DTYPE])
            for state in states:
                torch.testing.assert_close(state["body.0.weight"], got["frozen"], rtol=0, atol=0)  # frozen: unmoved
                assert state.keys() == expected.state_dict().keys(), (rank, case)
                for key, value in expected.state_dict().items():
                    torch.testing.assert_close(state[key], value, **TOL[DTYPE], msg=lambda m, k=key: f"{case} {k}: {m}")
            if "loaded" in got:
                name, loaded = got["loaded"]
                assert name == "FlagNet"
                for key, value in expected.state_dict().items():
                    torch.testing.assert_close(loaded[key], value, **TOL[DTYPE])


def test_changes_between_steps_reach_the_placed_modules_under_model_parallel(reference):
    from conftest import cpu_registry

    expected, frozen_expected = reference
    strategy = sg.ModelParallelStrategy(
        placement={"body": "cpu:0", "head": "cpu:1", "aux": "cpu:2"}, registry=cpu_registry(3)
    )
    try:
        model, frozen = train_with(strategy, dataset=batches())
        torch.testing.assert_close(frozen, frozen_expected, **TOL[DTYPE])
        assert model.module.use_aux is ((STEPS - 1) % 2 == 0) and "use_aux" not in vars(model)
        assert not model.body[0].weight.requires_grad
        for key, value in expected.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, **TOL[DTYPE], msg=lambda m, k=key: f"{k}: {m}")
        with pytest.raises(sg.InputError, match=r"placed module by module cannot be saved whole.*state_dict\(\)"):
            torch.save(model, io.BytesIO())
    finally:
        strategy.close()


def test_a_pipelines_pickle_is_the_users_sequential():
    from conftest import cpu_registry

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)
    strategy = sg.ModelParallelStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    try:
        model = strategy.distribute(net)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.Tanh]):
            loaded = torch.load(buffer, weights_only=True)
        assert type(loaded) is nn.Sequential
        x = torch.randn(3, 6, dtype=DTYPE)
        torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)
    finally:
        strategy.close()


@pytest.mark.timeout(60)
def test_a_change_on_the_parameter_server_coordinator_is_refused_and_one_inside_a_function_reaches_its_worker():
    from stratagem.strategies.parameter_server import ClusterCoordinator, InProcessCluster, ParameterServerStrategy

    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        model, optimizer = strategy.distribute(*build())
        for change, text in [
            (lambda: setattr(model, "use_aux", False), r"model\.use_aux = \.\.\."),
            (lambda: model.requires_grad_(False), r"model\.requires_grad_\(False\)"),
            (lambda: model.apply(lambda m: None), r"model\.apply\(fn\)"),
            (lambda: delattr(model, "use_aux"), r"del model\.use_aux"),
        ]:
            with pytest.raises(sg.InputError, match=rf"reach no worker.*Received: {text} on the coordinator"):
                change()
        assert model.module.use_aux is True
        coordinator = ClusterCoordinator(strategy)

        def flag_off() -> bool:
            model.use_aux = False  # this worker's replica
            return model.use_aux

        assert coordinator.fetch(coordinator.schedule(flag_off)) is False
        strategy.shutdown()
