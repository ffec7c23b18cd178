"""Turning global batches into per-replica batches."""

from stratagem.data.distributed_dataset import DistributedDataset
from stratagem.data.files import FileDataset
from stratagem.data.resume import ShuffledBatches
from stratagem.data.split import InputContext, split_batch, split_sizes

__all__ = ["DistributedDataset", "FileDataset", "InputContext", "ShuffledBatches", "split_batch", "split_sizes"]
