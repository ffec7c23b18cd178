"""Run by tests/test_torchrun_store.py under torchrun: build a MultiWorkerMirroredStrategy twice, all-reduce, close."""

import torch

import stratagem as sg

for attempt in range(2):  # a second strategy after close() meets again on the agent's store
    strategy = sg.MultiWorkerMirroredStrategy()
    total = strategy.reduce("sum", torch.tensor(1.0))
    strategy.print(f"meeting {attempt}: sum over ranks {total.item():g}")
    strategy.close()
