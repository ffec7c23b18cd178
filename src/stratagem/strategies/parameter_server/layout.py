"""One parameter server's buckets as a worker sees them, and the copies that go with them.

A server keeps the shards it holds in buckets, one per optimizer parameter group and dtype
(``store.bucket_layout``). A worker works out the same buckets from its own tensors, once per
server (``Layout.build``), and sends their ``fingerprint`` with every pull and push, so a server
that holds other shards refuses the call. With the buckets known, a push sends a bucket's
gradients as one ``wire.Flat`` (gathered through its ``staging``), a pull is received straight
into the parameters' shard views (``destinations``), and values that arrive whole are copied out
into them (``copy_out``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from stratagem.errors import ParameterServerError
from stratagem.shm import parameter_server as shared
from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.partitioners import Shard, shard_of
from stratagem.strategies.parameter_server.store import bucket_layout, bucket_name, fingerprint


class Layout:
    """One server's buckets seen from a worker, and the ``wire.Flat`` destinations of the last parameters pulled."""

    def __init__(
        self,
        fingerprint: str,
        buckets: list[list[Shard]],
        sizes: list[tuple[torch.dtype, int]],
        shapes: list[list[torch.Size]],
    ) -> None:
        self.fingerprint = fingerprint
        self.buckets = buckets
        self.sizes = sizes  # each bucket's dtype and element count
        self.shapes = shapes  # each shard's shape, bucket by bucket
        self.staging = [wire.Staging() for _ in buckets]  # for gathering each bucket's small gradients
        self.parameters = [[s.parameter for s in bucket] for bucket in buckets]  # each shard's parameter name
        self.whole = [all(s.name == s.parameter for s in bucket) for bucket in buckets]  # no parameter split
        self._pulled: list[torch.Tensor] = []  # kept alive, so their id()s below cannot be reused
        self._pulled_key: tuple[list[int], list[int]] = ([], [])
        self._destinations: dict[str, wire.Flat] | None = None

    @classmethod
    def build(cls, ps: int, shards: list[Shard], tensors: Mapping[str, torch.Tensor | None]) -> Layout:
        """The buckets of server ``ps``, which holds ``shards``, as it keeps them (``store.bucket_layout``), from
        this worker's tensors of the shards' parameters."""
        missing = [s.parameter for s in shards if tensors.get(s.parameter) is None]
        if missing:
            raise ParameterServerError(
                f"Cannot tell the dtypes of the shards on ps:{ps}. Received: no tensor for {missing[:3]}. "
                "Pull the values (run the model) before the first push."
            )
        known = cast("Mapping[str, torch.Tensor]", tensors)  # every shard's tensor is there: checked just above
        entries = [(s.name, s.group, known[s.parameter].dtype, shard_of(known[s.parameter], s).numel()) for s in shards]
        by_name = {s.name: s for s in shards}
        members = bucket_layout(entries)
        buckets = [[by_name[name] for name, _ in bucket] for bucket in members]
        dtypes = [known[bucket[0].parameter].dtype for bucket in buckets]
        sizes = [(dtype, sum(n for _, n in bucket)) for dtype, bucket in zip(dtypes, members)]
        shapes = [[shard_of(known[s.parameter], s).shape for s in bucket] for bucket in buckets]
        return cls(fingerprint(entries), buckets, sizes, shapes)

    def copy_out(self, buckets: Sequence[torch.Tensor], parameters: Mapping[str, torch.Tensor]) -> bool:
        """Copies each bucket's values (1-D, shards one after another) into the parameters' shard views, with
        one call when all are CPU tensors; False (nothing copied) when the shards' shapes are not this layout's."""
        targets, sources = [], []
        for bucket, flat, shapes in zip(self.buckets, buckets, self.shapes):
            views = [shard_of(parameters[s.parameter], s) for s in bucket]
            if [v.shape for v in views] != shapes:
                return False
            targets.extend(views)
            sources.extend(torch._C._nn.unflatten_dense_tensors(flat, views))
        shared.copy_all(targets, sources)
        return True

    def destinations(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, wire.Flat] | None:
        """A ``Flat`` of the parameters' shard views per bucket (kept while the same tensors, with the same
        memory, are pulled into), or None when some are not contiguous CPU tensors."""
        tensors = [parameters[s.parameter] for bucket in self.buckets for s in bucket]
        # Lists of ints compare in C: this check runs at every pull, over every shard.
        key = ([id(t) for t in tensors], [t.data_ptr() for t in tensors])
        if self._destinations is not None and key == self._pulled_key:
            return self._destinations
        views = [[shard_of(parameters[s.parameter], s).detach() for s in bucket] for bucket in self.buckets]
        if not all(v.device.type == "cpu" and v.is_contiguous() for bucket in views for v in bucket):
            return None
        self._destinations = {bucket_name(i): wire.Flat(bucket) for i, bucket in enumerate(views)}
        self._pulled, self._pulled_key = tensors, key
        return self._destinations
