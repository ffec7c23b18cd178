"""STRATAGEM_SHARED_MEMORY: one switch that turns off both shared-memory transports.

What is checked: the values the switch takes (and an error for any other); the reason both
transports' eligibility gives; an explicit ``shared_memory=True`` against the switch is an
``InputError`` before any work starts, in both strategies; and a multi-worker job run with the
switch off sums through Gloo, says so in ``explain()``, warns of nothing, and still matches one
device. The parameter server's side is checked in tests/test_ps_shared.py, the sums' meeting in
tests/test_shared_memory.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from cases import BATCH_SIZES, TOL, build, make_batches, train_reference

import stratagem as sg
from stratagem import environ
from stratagem.cluster import launch
from stratagem.shm import eligibility, sums
from stratagem.shm import parameter_server as ps_shared

WORKER = str(Path(__file__).parent / "workers" / "mwms_train.py")


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, None), ({"STRATAGEM_SHARED_MEMORY": ""}, None), ({"STRATAGEM_SHARED_MEMORY": " 0 "}, "0")],
)
def test_the_switch_is_read_as_set_and_unset_when_empty(env, expected):
    assert environ.shared_memory_setting(env) == expected


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_the_switch_turns_shared_memory_off_and_says_so(value):
    assert (
        eligibility.turned_off({"STRATAGEM_SHARED_MEMORY": value}) == f"turned off by STRATAGEM_SHARED_MEMORY={value}"
    )


@pytest.mark.parametrize("value", ["1", "true", "On", "yes", ""])
def test_the_switch_set_on_or_left_empty_leaves_shared_memory_on(value):
    assert eligibility.turned_off({"STRATAGEM_SHARED_MEMORY": value}) is None
    assert eligibility.turned_off({}) is None


def test_any_other_value_of_the_switch_is_an_input_error():
    with pytest.raises(
        sg.InputError,
        match=r"STRATAGEM_SHARED_MEMORY must be 0 \(shared memory off\) or 1 \(on\). "
        r"Received: STRATAGEM_SHARED_MEMORY='maybe'. Set it to 0",
    ):
        eligibility.turned_off({"STRATAGEM_SHARED_MEMORY": "maybe"})


def test_both_transports_give_the_switch_as_their_reason(monkeypatch):
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")
    assert sums.eligible() == "turned off by STRATAGEM_SHARED_MEMORY=0"
    assert ps_shared.eligible() == "turned off by STRATAGEM_SHARED_MEMORY=0"
    assert ps_shared.make_file([(torch.float32, 4)]) == "turned off by STRATAGEM_SHARED_MEMORY=0"


def test_a_directory_that_is_missing_or_not_writable_is_a_reason(tmp_path, monkeypatch):
    assert (
        eligibility.why_not("shared-memory sums", str(tmp_path / "none"), ordered=False, env={})
        == f"{tmp_path / 'none'} does not exist"
    )
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a user without write access (not root)
    assert (
        eligibility.why_not("shared-memory sums", str(tmp_path), ordered=False, env={})
        == f"this user cannot create files in {tmp_path}"
    )


def test_a_platform_without_ordered_stores_is_named(monkeypatch):
    monkeypatch.setattr(eligibility.platform, "machine", lambda: "aarch64")
    assert eligibility.ordered_stores("shared-memory sums") == (
        f"shared-memory sums need Linux on x86-64 (ordered stores without explicit fences); this is {sys.platform} "
        "on aarch64"
    )
    assert eligibility.why_not("shared-memory sums", ordered=True, env={}).startswith("shared-memory sums need Linux")


def test_shared_memory_true_against_the_switch_is_refused_and_the_default_follows_it():
    off = {"STRATAGEM_SHARED_MEMORY": "0"}
    with pytest.raises(
        sg.InputError,
        match=r"shared_memory=True asks for shared memory, but STRATAGEM_SHARED_MEMORY=0 "
        r"turns it off for this process, and the switch wins .* Received: "
        r"shared_memory=True, STRATAGEM_SHARED_MEMORY=0. Unset "
        r"STRATAGEM_SHARED_MEMORY to use shared memory, or leave shared_memory",
    ):
        eligibility.check_wanted(True, off)
    eligibility.check_wanted(None, off)
    eligibility.check_wanted(False, off)
    eligibility.check_wanted(True, {})


def test_multi_worker_mirrored_refuses_shared_memory_true_with_the_switch_off_before_any_work(monkeypatch):
    # Before the cluster is even resolved: no process group, no rendezvous, no wait.
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")
    with pytest.raises(sg.InputError, match="shared_memory=True asks for shared memory, but STRATAGEM_SHARED_MEMORY=0"):
        sg.MultiWorkerMirroredStrategy(shared_memory=True)
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "maybe")
    with pytest.raises(sg.InputError, match="STRATAGEM_SHARED_MEMORY must be 0"):
        sg.MultiWorkerMirroredStrategy()


def test_the_sharded_strategy_refuses_shared_memory_true_with_the_switch_off_before_any_work(monkeypatch):
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")
    with pytest.raises(sg.InputError, match="shared_memory=True asks for shared memory, but STRATAGEM_SHARED_MEMORY=0"):
        sg.ShardedStrategy(shared_memory=True)


def test_the_parameter_server_strategy_refuses_shared_memory_true_with_the_switch_off():
    with pytest.raises(
        sg.InputError, match="shared_memory=True asks for shared memory, but STRATAGEM_SHARED_MEMORY=off"
    ):
        sg.ParameterServerStrategy(shared_memory=True, env={"STRATAGEM_SHARED_MEMORY": "off"})


@pytest.mark.timeout(60)
def test_the_parameter_server_explains_the_switch_before_any_pull():
    from stratagem.strategies.parameter_server import InProcessCluster

    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = sg.ParameterServerStrategy(cluster, env={"STRATAGEM_SHARED_MEMORY": "0"})
        try:
            (decision,) = [
                d for d in strategy.explain().decisions if d.subject == "values between workers and parameter servers"
            ]
        finally:
            strategy.shutdown()
    assert decision.choice == "gRPC"
    assert decision.reason == "shared memory turned off by STRATAGEM_SHARED_MEMORY=0, so every value travels over gRPC"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_multi_worker_job_with_the_switch_off_sums_through_gloo_and_matches_one_device(tmp_path):
    out = tmp_path / "result.pt"
    env = {**environ.current(), "STRATAGEM_SHARED_MEMORY": "0", "MW_OUT": str(out)}
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=2,
        env=env,
        sink=lambda line: lines.append(line.text),
        timeout=120,
        grace_period=2,
    )
    assert result.exit_code == 0, "\n".join(lines[-30:])
    saved = torch.load(out)
    assert "cross-worker sums: gloo - turned off by STRATAGEM_SHARED_MEMORY=0" in saved["explain"], saved["explain"]
    assert not [line for line in lines if "slower than shared memory" in line]  # asked for: nothing to warn of
    reference, ref_opt, shape = build("mlp", "sgd_momentum", torch.float64)
    train_reference(reference, ref_opt, make_batches(shape, torch.float64, sizes=BATCH_SIZES))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(saved["state"][key], value, **TOL[torch.float64])
