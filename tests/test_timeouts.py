"""Every timeout argument is checked by one rule (stratagem.timeouts): a real number of seconds, not a
bool, finite, above zero, at most a day; refused with an InputError naming the argument and the value."""

from __future__ import annotations

import math
import sys
from datetime import timedelta

import pytest

import stratagem as sg
from stratagem.bench.scaling import ScalingConfig
from stratagem.cli.main import main
from stratagem.cluster import free_ports, init_process_group, single_process
from stratagem.cluster.launch import launch as launch_command
from stratagem.strategies.parameter_server.coordinator import ClusterCoordinator, RemoteValue
from stratagem.timeouts import MAX_SECONDS, check_seconds


def _ps_cluster() -> dict:
    ports = free_ports(3)
    return {
        "cluster": {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{ports[1]}"],
            "ps": [f"127.0.0.1:{ports[2]}"],
        },
        "task": {"type": "chief", "index": 0},
    }


def _noop() -> None:
    return None


# Each entry point, called with the bad value as the named argument; the name is what the error must say.
ENTRY_POINTS = {
    "OneDeviceStrategy": ("timeout", lambda v: sg.OneDeviceStrategy("cpu", timeout=v)),
    "MirroredStrategy": ("timeout", lambda v: sg.MirroredStrategy(["cpu:0"], timeout=v)),
    "CentralStorageStrategy": ("timeout", lambda v: sg.CentralStorageStrategy(["cpu:0"], timeout=v)),
    "MultiWorkerMirroredStrategy": ("timeout", lambda v: sg.MultiWorkerMirroredStrategy(timeout=v)),
    "ModelParallelStrategy": ("timeout", lambda v: sg.ModelParallelStrategy(["cpu:0"], timeout=v)),
    "ParameterServerStrategy.rpc_timeout": (
        "rpc_timeout",
        lambda v: sg.ParameterServerStrategy(_ps_cluster(), cluster_token="t", rpc_timeout=v, env={}),
    ),
    "ParameterServerStrategy.chief_timeout": (
        "chief_timeout",
        lambda v: sg.ParameterServerStrategy(_ps_cluster(), cluster_token="t", chief_timeout=v, env={}),
    ),
    "ClusterCoordinator.closure_timeout": ("closure_timeout", lambda v: ClusterCoordinator(None, closure_timeout=v)),
    "ClusterCoordinator.worker_recovery_timeout": (
        "worker_recovery_timeout",
        lambda v: ClusterCoordinator(None, worker_recovery_timeout=v),
    ),
    "ClusterCoordinator.heartbeat_interval": (
        "heartbeat_interval",
        lambda v: ClusterCoordinator(None, heartbeat_interval=v),
    ),
    "ClusterCoordinator.heartbeat_timeout": (
        "heartbeat_timeout",
        lambda v: ClusterCoordinator(None, heartbeat_timeout=v),
    ),
    "RemoteValue.fetch": ("timeout", lambda v: RemoteValue("f", 1.0).fetch(timeout=v)),
    "init_process_group.timeout": ("timeout", lambda v: init_process_group(single_process(), "gloo", timeout=v)),
    "init_process_group.group_timeout": (
        "group_timeout",
        lambda v: init_process_group(single_process(), "gloo", timeout=5, group_timeout=v),
    ),
    "cluster.launch": (
        "timeout",
        lambda v: launch_command([sys.executable, "-c", "pass"], workers=1, env={}, sink=print, timeout=v),
    ),
    "sg.launch": ("timeout", lambda v: sg.launch(_noop, workers=1, timeout=v)),
    "ScalingConfig": ("timeout_s", lambda v: ScalingConfig(timeout_s=v)),
}

BAD_VALUES = [float("nan"), math.inf, -math.inf, 1e30, MAX_SECONDS + 1, 0, -1.0, "10", True, False, b"1"]


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_bad_timeout_naming_it(entry, value):
    name, call = ENTRY_POINTS[entry]
    with pytest.raises(sg.InputError) as caught:
        call(value)
    message = str(caught.value)
    assert message.startswith(f"{name} must be a finite number of seconds in (0, 86400]. Received: {name}={value!r}")
    assert "Pass seconds as an int or float" in message


@pytest.mark.parametrize(
    ("value", "seconds"), [(1, 1.0), (0.5, 0.5), (86_400, 86_400.0), (timedelta(minutes=2), 120.0)]
)
def test_good_values_come_back_as_float_seconds(value, seconds):
    result = check_seconds("timeout", value)
    assert type(result) is float and result == seconds


def test_zero_is_allowed_only_where_the_argument_is_a_delay():
    assert check_seconds("ps_exit_delay", 0, allow_zero=True) == 0.0
    with pytest.raises(sg.InputError, match=r"ps_exit_delay must be a finite number of seconds in \[0, 86400\]"):
        sg.ParameterServerStrategy(_ps_cluster(), cluster_token="t", ps_exit_delay=math.nan, env={})
    with pytest.raises(sg.ClusterError, match=r"grace_period must be .* in \[0, 86400\]\. Received: grace_period=inf"):
        launch_command([sys.executable, "-c", "pass"], workers=1, env={}, sink=print, grace_period=math.inf)


def test_a_launch_keeps_its_documented_error_class():
    with pytest.raises(sg.ClusterError, match=r"Received: timeout=nan"):
        launch_command([sys.executable, "-c", "pass"], workers=1, env={}, sink=print, timeout=math.nan)


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["launch", "--workers", "1", "--timeout", "nan", "--", sys.executable, "-c", "pass"], "timeout"),
        (["launch", "--workers", "1", "--grace-period", "inf", "--", sys.executable, "-c", "pass"], "grace_period"),
        (["bench", "--quick", "--timeout", "1e30"], "timeout_s"),
    ],
)
def test_cli_options_refuse_a_bad_timeout_with_exit_2(capsys, tmp_path, argv, name):
    if argv[0] == "bench":
        argv = [*argv, "--out", str(tmp_path)]
    assert main(argv) == 2
    assert f"{name} must be a finite number of seconds" in capsys.readouterr().err
