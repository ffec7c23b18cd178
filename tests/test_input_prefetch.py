"""Input copies on a side stream, and the next batch distributed before the current one is yielded.

No GPU: torch.cuda's streams are mocked by objects that record what is done with them, and the
tensors are stand-ins that record their copies. What is checked is the order the CUDA semantics
rules ask for: the copy inside the input stream, the compute stream waiting for it, record_stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from stratagem.data import distributed_dataset, prefetch

CUDA0 = torch.device("cuda", 0)


class Journal(list):
    active: str = "compute"


@pytest.fixture
def journal(monkeypatch):
    log = Journal()

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    @contextlib.contextmanager
    def stream(s):
        before, log.active = log.active, s.name
        yield
        log.active = before

    compute = Stream("compute")
    monkeypatch.setattr(prefetch, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream(f"input({device})"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log


class HostTensor:
    def __init__(self, log, pinned):
        self.log, self.pinned = log, pinned

    def is_pinned(self):
        return self.pinned

    def to(self, device, non_blocking=False):
        self.log.append(f"copy to {device} on {self.log.active}, non_blocking={non_blocking}")
        return DeviceTensor(self.log)


class DeviceTensor:
    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.append(f"used on {stream.name}")


def test_a_pinned_batch_goes_to_the_gpu_on_the_input_stream_and_the_compute_stream_waits(journal):
    prefetch.copy_to_device(HostTensor(journal, pinned=True), CUDA0)
    assert journal == [
        "copy to cuda:0 on input(cuda:0), non_blocking=True",
        "compute waits for input(cuda:0)",
        "used on compute",
    ]
    prefetch.copy_to_device(HostTensor(journal, pinned=True), CUDA0)
    assert len(prefetch._STREAMS) == 1  # one input stream per GPU


def test_a_pageable_batch_or_a_cpu_destination_is_copied_as_before(journal):
    prefetch.copy_to_device(HostTensor(journal, pinned=False), CUDA0)
    prefetch.copy_to_device(HostTensor(journal, pinned=True), torch.device("cpu"))
    assert journal == ["copy to cuda:0 on compute, non_blocking=False", "copy to cpu on compute, non_blocking=True"]
    assert prefetch._STREAMS == {}


def test_with_a_gpu_replica_the_next_batch_is_distributed_before_the_current_one_is_yielded(monkeypatch):
    order = []
    monkeypatch.setattr(
        distributed_dataset, "distribute_batch", lambda batch, devices, step: order.append(f"copy {step}") or step
    )
    dataset = distributed_dataset.DistributedDataset(lambda: [CUDA0], [10, 11, 12])
    for step in dataset:
        order.append(f"step {step}")
    assert order == ["copy 0", "copy 1", "step 0", "copy 2", "step 1", "step 2"]


def test_cpu_replicas_distribute_each_batch_when_it_is_asked_for(monkeypatch):
    order = []
    monkeypatch.setattr(
        distributed_dataset, "distribute_batch", lambda batch, devices, step: order.append(f"copy {step}") or step
    )
    dataset = distributed_dataset.DistributedDataset(lambda: [torch.device("cpu")], [10, 11])
    for step in dataset:
        order.append(f"step {step}")
    assert order == ["copy 0", "step 0", "copy 1", "step 1"]
