"""torch.compile: a model compiled before or after `distribute` trains exactly as the plain model on one device.

Compiled with `backend="aot_eager"`: AOTAutograd traces the forward and backward into graphs, as the
default inductor backend does, so the gradients reach the strategy's hooks from a compiled backward
graph, and each replica's module is a separate guard on the compiled code; but no C++ is generated,
which takes a minute or more per graph on this project's 2-core machines. aot_eager runs the same
aten operations as eager mode, so the comparison keeps the float64 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference, train_step
from conftest import cpu_registry
from helpers import launch_workers

import stratagem as sg

BACKEND = "aot_eager"
SIZES = [12, 7, 2]  # uneven over 2 and 3 replicas, and an empty slice for the third


@pytest.fixture(autouse=True)
def _keep_torchs_recompile_limit():
    """distribute raises torch's process-wide recompile limit for compiled models: put it back after each test."""
    from torch._dynamo import config as dynamo_config

    limit = dynamo_config.recompile_limit
    yield
    dynamo_config.recompile_limit = limit


STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-2-shared": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3-copies": lambda: sg.MirroredStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], share_parameters=False, registry=cpu_registry(3)
    ),
}


def train_compiled(strategy, when: str, batches):
    """The loop of tests/cases.py with the model compiled `when` ("before" or "after") distribute."""
    model, opt, _ = build("mlp", "adam", torch.float64)
    if when == "before":
        model = torch.compile(model, backend=BACKEND)
        model, opt = strategy.distribute(model, opt)
        distributed = model
    else:
        distributed, opt = strategy.distribute(model, opt)
        model = torch.compile(distributed, backend=BACKEND)
    step = train_step(model, opt)
    for x, y in strategy.distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    return distributed


def _plain_state(module) -> dict[str, torch.Tensor]:
    """A replica's state with torch.compile's `_orig_mod.` prefix taken off."""
    return {k.replace("_orig_mod.", ""): v for k, v in module.state_dict().items()}


# With one replica distribute hands back the model itself, so "after" would repeat "before" there.
CASES = [
    ("one-device", "before"),
    ("mirrored-2-shared", "before"),
    ("mirrored-2-shared", "after"),
    ("mirrored-3-copies", "before"),
    ("mirrored-3-copies", "after"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy_name,when", CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_a_compiled_model_matches_the_plain_model_on_one_device(strategy_name, when):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=SIZES)
    train_reference(reference, ref_opt, batches)
    strategy = STRATEGIES[strategy_name]()
    try:
        distributed = train_compiled(strategy, when, batches)
    finally:
        strategy.close()
    assert counters["aot_autograd"]["ok"] > 0, dict(counters["aot_autograd"])  # it did run compiled
    for replica in getattr(distributed, "replicas", [distributed]):
        got = _plain_state(replica)
        for key, want in reference.state_dict().items():
            torch.testing.assert_close(got[key], want, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_compiled_model_across_two_workers_matches_one_device(tmp_path):
    """One replica per worker: distribute hands back the compiled model itself, its gradients go
    through the all-reduce buckets as the compiled backward produces them."""
    out = tmp_path / "result.pt"
    when = "before"
    exit_code, output = launch_workers(
        "compile_train.py",
        {
            "COMPILE_OUT": str(out),
            "COMPILE_WHEN": when,
            "COMPILE_BACKEND": BACKEND,
            "COMPILE_SIZES": ",".join(map(str, SIZES)),
        },
        timeout=200,
        tail=30,
    )
    assert exit_code == 0, output
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    train_reference(reference, ref_opt, make_batches(shape, torch.float64, sizes=SIZES))
    for rank in range(2):
        saved = torch.load(f"{out}.{rank}")
        assert saved["compiled_graphs"] > 0
        got = {k.replace("_orig_mod.", ""): v for k, v in saved["state"].items()}
        for key, want in reference.state_dict().items():
            torch.testing.assert_close(got[key], want, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(180)
def test_every_replica_stays_compiled_past_torchs_recompile_limit():
    """3 replicas and 10 batch sizes fill torch's cache of compiled entries per code object (without the
    extra room: 9 frames, 7 compiled, the rest eager for good); distribute gives each replica the room
    one device has."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dynamo_config.recompile_limit = 6  # the user's own setting: each replica gets that much room
    strategy = STRATEGIES["mirrored-3-copies"]()
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    model, opt = strategy.distribute(torch.compile(model, backend="eager"), opt)
    assert dynamo_config.recompile_limit == 18
    assert strategy.explain().decision("torch.compile").choice == "recompile limit 18 (at least 6 per replica)"
    for x, y in strategy.distribute_dataset(
        make_batches(shape, torch.float64, sizes=[12, 11, 7, 2, 5, 9, 13, 4, 8, 10])
    ):
        strategy.run(lambda a, b: F.cross_entropy(model(a), b).backward(), args=(x, y))
    strategy.close()
    assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["frames"])
