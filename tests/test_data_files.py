"""FileDataset: batches read across file boundaries, in order."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg


def test_batches_cross_file_boundaries_in_order():
    contents = {"a": torch.arange(0, 5), "b": torch.arange(5, 8), "c": torch.arange(8, 12)}
    dataset = sg.data.FileDataset(["a", "b", "c"], lambda name: (contents[name], contents[name] * 10), batch_size=4)
    batches = list(dataset)
    assert [x.tolist() for x, _ in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert batches[1][1].tolist() == [40, 50, 60, 70]
    short = dataset.with_files(["a", "b"], batch_size=3)
    assert [x.tolist() for x, _ in short] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_file_dataset_rejects_an_empty_list_and_a_bad_batch_size():
    with pytest.raises(sg.InputError, match=r"non-empty list of files. Received: files=\[\]"):
        sg.data.FileDataset([], torch.load, batch_size=4)
    with pytest.raises(sg.InputError, match=r"batch_size must be at least 1. Received: batch_size=0"):
        sg.data.FileDataset(["a"], torch.load, batch_size=0)
