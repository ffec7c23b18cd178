"""Device names in TensorFlow's and torch's spellings."""

from __future__ import annotations

import pytest
import torch

from stratagem.devices import DeviceSpec, parse_device
from stratagem.errors import DeviceError


@pytest.mark.parametrize(
    "name, device_type, index",
    [
        ("/gpu:0", "cuda", 0),
        ("/GPU:2", "cuda", 2),
        ("/device:GPU:1", "cuda", 1),
        ("/device:gpu:1", "cuda", 1),
        ("/cpu:0", "cpu", 0),
        ("/device:CPU:3", "cpu", 3),
        ("GPU:1", "cuda", 1),
        ("cuda", "cuda", None),
        ("cuda:1", "cuda", 1),
        ("cpu", "cpu", None),
        ("cpu:3", "cpu", 3),
        (" cuda:0 ", "cuda", 0),
        ("/device:GPU:*", "cuda", None),
    ],
)
def test_parse_both_spellings(name, device_type, index):
    assert parse_device(name) == DeviceSpec(device_type=device_type, index=index)


def test_parse_qualified_tf_name():
    spec = parse_device("/job:worker/replica:0/task:1/device:GPU:0")
    assert spec == DeviceSpec(job="worker", replica=0, task=1, device_type="cuda", index=0)
    assert spec.is_qualified
    assert spec.tf_name == "/job:worker/replica:0/task:1/device:GPU:0"
    assert spec.torch_name == "cuda:0"


@pytest.mark.parametrize(
    "device, expected",
    [
        (torch.device("cuda", 1), DeviceSpec(device_type="cuda", index=1)),
        (torch.device("cuda"), DeviceSpec(device_type="cuda", index=None)),
        (torch.device("cpu"), DeviceSpec(device_type="cpu", index=None)),
    ],
)
def test_parse_torch_device(device, expected):
    assert parse_device(device) == expected


def test_names_in_both_directions():
    assert parse_device("cpu:3").tf_name == "/device:CPU:3"
    assert parse_device("/device:GPU:1").torch_name == "cuda:1"
    assert parse_device("cuda").torch_name == "cuda"
    assert parse_device("cuda").tf_name == "/device:GPU:*"
    assert not parse_device("cuda:0").is_qualified


@pytest.mark.parametrize("name", ["/tpu:0", "tpu:0", "mps", "/device:TPU:0"])
def test_unsupported_type_quotes_name_and_spellings(name):
    with pytest.raises(DeviceError, match=r"not supported.*Received: name='.*(tpu|TPU|mps).*'.*Use 'cpu'"):
        parse_device(name)


@pytest.mark.parametrize(
    "name",
    ["cuda:x", "gpu0", "", "/gpu:0/cpu:0", "/job:worker/task:one/device:GPU:0", "/job:a/job:b/device:GPU:0", "cuda:-1"],
)
def test_malformed_name(name):
    with pytest.raises(DeviceError, match=r"not recognised\. Received: name=.*Use 'cpu', 'cpu:N'"):
        parse_device(name)


def test_tf_name_without_device_part():
    with pytest.raises(
        DeviceError,
        match=r"has no device part\. Received: name='/job:worker/task:1'\. "
        r"Add one, e\.g\. /job:worker/task:1/device:GPU:0",
    ):
        parse_device("/job:worker/task:1")


def test_torch_device_of_other_type():
    with pytest.raises(DeviceError, match=r"Received: name='meta'"):
        parse_device(torch.device("meta"))


def test_non_string():
    with pytest.raises(DeviceError, match=r"string or a torch\.device\. Received: name=0 of type int"):
        parse_device(0)
