"""Turning global batches into per-replica batches."""

from stratagem.data.split import InputContext, split_batch, split_sizes

__all__ = ["InputContext", "split_batch", "split_sizes"]
