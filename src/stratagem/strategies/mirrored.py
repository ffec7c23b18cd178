"""MirroredStrategy: one process, one persistent model replica per device, synchronous updates.

Each replica keeps its own copy of the model and optimizer; `run` executes the step function
once per replica, in parallel threads (replica 0 on the caller's thread). When a replica's
`loss.backward()` finishes, the replicas meet and combine their gradients, each weighted by
the replica's share of the global batch, so by the time `backward()` returns every replica
holds the gradient of the mean loss over the whole global batch. Clipping and the optimizer
then see the same combined gradient on every replica and apply the same update.

The strategy is a `ReplicaSet` built from the parts its class lists (strategies/data_parallel/replica_set.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import torch

from stratagem import devices as sg_devices
from stratagem import diagnose  # noqa: F401  (reached as mirrored.diagnose, as before the placement moved)
from stratagem.strategies.data_parallel.batch_norm import check_batch_norm_mode
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import nccl_available as _nccl_available
from stratagem.strategies.data_parallel.placement import place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy, check_timeout
from stratagem.trace import Recorder, Traceable
from stratagem.trace.recorder import Clock
from stratagem.trace.traceable import record_alone

logger = logging.getLogger(__name__)


class MirroredStrategy(ReplicatedStrategy, Traceable):
    """Synchronous data parallelism over the devices of one process (tf.distribute.MirroredStrategy).

    Args:
        devices: device names in TF or torch spelling (`["/gpu:0", "cuda:1"]`, `["cpu:0", "cpu:1"]`).
            None: every visible GPU, or the CPU when there is none (and `explain()` says why).
        require_gpu: raise `GpuUnavailableError`, with the diagnosis, instead of running on the CPU.
        timeout: seconds any replica waits for the others before failing with an error naming them.
        intra_op_threads: torch intra-op threads per CPU replica (default: the process's threads
            shared evenly among the CPU replicas, at least one each).
        share_parameters: when every replica is on one physical device (logical CPU devices), keep
            one copy of the parameters and optimizer state, each replica updating 1/N of it
            (None: whenever the optimizer allows it; False: a private copy per replica).
        batch_norm: "global" (default): BatchNorm layers normalise with the statistics of the whole
            global batch, forward and backward, as on one device, and every replica keeps the same
            running statistics; "per_replica": each replica's own slice (TensorFlow's default, cheaper).

    Example:
        >>> strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(net.parameters(), lr=0.1))
        >>> for x, y in strategy.distribute_dataset(loader):
        ...     losses = strategy.run(train_step, args=(x, y))
        ...     print(strategy.reduce("mean", losses))
    """

    samples_steps: ClassVar[bool] = True  # ReplicaSet ends every step with Recorder.after_step (fit samples them)

    # Parts, in the order a step meets them (each reports its own decisions to explain()):
    #   placement   mirrored_placement.place_replicas: devices, one replica per GPU, memory limits, threads
    #   replicas    mirrored_replicas.MirroredReplicas: a copy per device (or one shared copy, sharded.py)
    #               and their optimizer; compiled models, CUDA random streams
    #   combine     combine.choose_local_combine: in memory, NCCL or onto one device, at the end of backward
    #   the set     replica_set.ReplicaSet: replica threads and barrier, run's weights, BatchNorm statistics,
    #               empty slices, declared loss weights, accumulation under no_sync()

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        require_gpu: bool = False,
        timeout: float = 300.0,
        intra_op_threads: int | None = None,
        share_parameters: bool | None = None,
        batch_norm: str = "global",
        registry: sg_devices.DeviceRegistry | None = None,
    ) -> None:
        mode = check_batch_norm_mode(batch_norm)
        timeout = check_timeout(timeout)
        placement = place_replicas(
            devices, require_gpu=require_gpu, registry=registry, intra_op_threads=intra_op_threads
        )
        combine = choose_local_combine(placement.devices, nccl_available=_nccl_available(placement.devices))
        # Off until a trace starts (stratagem.trace): each replica thread's spans land on a track of its own.
        self._recorder = Recorder(rank=0, task="worker:0")
        self._replicas = ReplicaSet(
            self,
            placement,
            build=MirroredReplicas(share_parameters),
            combine=combine,
            batch_norm=mode,
            timeout=timeout,
            recorder=self._recorder,
        )

    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """Records the steps run inside the block: each step on the calling thread's track ("main"), each replica's
        forward, backward and optimizer step on its own thread's ("main" for replica 0, "replica <i>" for the
        others); writes `directory`/worker-0.json at its end (`stratagem trace summary DIR` reads it).

        Example:
            >>> with strategy.trace("traces/"):
            ...     strategy.run(train_step, args=(x, y))
        """
        with record_alone(self._recorder, directory, clock=clock, mode=mode) as recorder:
            yield recorder
