"""Checkpoints of a sharded model: every rank writes and reads only its own shards (``torch.distributed.checkpoint``).

`ShardedStateShards` is what `ShardedStrategy.state_shards()` hands `BackupAndRestore`. Saving takes the
model's and optimizer's sharded state with ``get_state_dict`` (DTensors: each rank's local shards, nothing
gathered), writes it with ``dcp.save`` (one ``__<rank>_<n>.distcp`` file per rank, ``.metadata`` from rank
0), then each rank hashes the files it wrote and every rank learns every rank's digests. `save_async` copies
this rank's shards into CPU buffers kept from one save to the next (DCP's `DefaultStager`) and returns the
rest, the write, the hashing and the digests, for a writer thread, which meets the other ranks' writer
threads on a Gloo group of its own (made at the first such save). Loading reads
the shards this rank needs at whatever number of ranks the checkpoint was written with (DCP reshards), or
cuts whole tensors of a single-file backup into this rank's shards (``set_state_dict(full_state_dict=True)``).

The optimizer's tensors are stored by position (``optimizer.<i>.<name>``, i the parameter's place in
``optimizer.state_dict()``), as a single-file backup numbers them, so a process that holds whole tensors
can read a sharded checkpoint into a plain ``optimizer.load_state_dict`` without this module (see
`stratagem.train.backup.sharded`). Only tensors go into the DCP files; hyper-parameters travel beside them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.state_shards import ShardFile, hash_file

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup


class ShardedStateShards:
    """Saving and loading an FSDP2 model and its optimizer, each rank its own shards (a `StateShards`)."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group
        self._saves = 0
        self._checkpoint_group: Any = None
        self._stager: Any = None

    def save(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[ShardFile]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        names = parameter_names(model, optimizer)
        dcp.save({"model": model_state, "optimizer": by_position(optimizer_state, names)}, checkpoint_id=directory)
        mine = self._hash_mine(directory, self._group.rank)
        self._saves += 1
        payloads = self._group.cross_worker.all_gather_bytes(
            json.dumps([vars(f) for f in mine]).encode(),
            what="checkpoint digests",
            step=self._saves,
            device=self._group.collective_device,
        )
        return [ShardFile(**entry) for payload in payloads for entry in json.loads(payload)]

    def save_async(
        self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Callable[[], list[ShardFile]]:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self._checkpoint_group is None:
            # Every rank makes it at its first asynchronous save (all ranks save after the same step). The
            # writes' collectives (DCP's plan and results, the digests) run on a writer thread while training's
            # own collectives run on the default group: on a group of their own, neither waits in the other's
            # queue, and no two threads ever issue collectives on one group.
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._group.timeout))
        if self._stager is None:
            # No pinned or shared memory (CPU copies), copied on this thread: the stager keeps each buffer for
            # the same tensor of the next save, so later saves write over memory already touched.
            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        names = parameter_names(model, optimizer)
        staged = self._stager.stage({"model": model_state, "optimizer": by_position(optimizer_state, names)})
        group, rank = self._checkpoint_group, self._group.rank

        def write() -> list[ShardFile]:
            import torch.distributed.checkpoint as dcp

            dcp.save(staged, checkpoint_id=directory, process_group=group)
            try:
                mine: Any = [vars(f) for f in self._hash_mine(directory, rank)]
            except OSError as error:  # every rank learns it, instead of waiting for the digests until the timeout
                mine = f"rank {rank} could not read back its files: {error}"
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            failed = [entry for entry in gathered if isinstance(entry, str)]
            if failed:
                raise OSError(f"The sharded checkpoint {str(directory)!r} was not written whole: {'; '.join(failed)}.")
            return [ShardFile(**entry) for files in gathered for entry in files]

        return write

    def close(self) -> None:
        # The buffers go; the group stays for this strategy's next fit, and ends with its other groups
        # (WorkerGroup.close). Not freed here, right after the last write: a Gloo thread may still be releasing
        # that write's finished collective, which takes the GIL, while the group's destructor, run with the GIL
        # held, waits for that thread (the hang described in stratagem.bench.multi_process.free_ddp_models).
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    @staticmethod
    def _hash_mine(directory: Path, rank: int) -> list[ShardFile]:
        return [
            hash_file(directory / name, rank)
            for name in sorted(p.name for p in directory.iterdir())
            if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata")
        ]

    def load(
        self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # The skeleton: this rank's shards, optimizer state made by a step at learning rate 0 when there is none.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        names = parameter_names(model, optimizer)
        positions = by_position(optimizer_state, names)
        dcp.load({"model": model_state, "optimizer": positions}, checkpoint_id=directory)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=by_name(positions, param_groups, names),
        )

    def load_whole(
        self,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        names = parameter_names(model, optimizer)
        state = {str(key): value for key, value in optimizer_state["state"].items()}
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=by_name(state, optimizer_state["param_groups"], names),
            options=StateDictOptions(full_state_dict=True),
        )


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in `model` of each parameter of `optimizer`, in the order ``optimizer.state_dict()`` numbers them."""
    named = {id(p): name for name, p in model.named_parameters()}
    names = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in named:
                raise InputError(
                    f"The optimizer holds a parameter that is not the model's (param_groups[{g}], shape "
                    f"{tuple(p.shape)}), so its state cannot be saved by name. Received: an optimizer over other "
                    "tensors. Pass the model and optimizer that strategy.distribute returned."
                )
            names.append(named[id(p)])
    return names


def by_position(optimizer_state: Mapping[str, Any], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``get_state_dict``'s optimizer state (keyed by parameter name) keyed by position instead; tensors only."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for position, name in enumerate(names):
        entry = optimizer_state["state"].get(name)
        if entry is None:
            continue
        others = sorted(key for key, value in entry.items() if not isinstance(value, torch.Tensor))
        if others:
            raise InputError(
                f"The optimizer keeps values other than tensors in its state ({others} of {name!r}), which a sharded "
                "checkpoint does not hold. Received: an optimizer whose state is not all tensors. Use a torch.optim "
                "optimizer whose state is tensors (SGD, Adam, AdamW, Adagrad...)."
            )
        out[str(position)] = dict(entry)
    return out


def by_name(
    positions: Mapping[str, Mapping[str, torch.Tensor]], param_groups: list[dict[str, Any]], names: list[str]
) -> dict[str, Any]:
    """The optimizer state `by_position` made, keyed by parameter name again, with `param_groups` (numbered as
    ``Optimizer.state_dict`` numbers them): the form ``set_state_dict`` takes."""
    groups = []
    for group in param_groups:
        groups.append({**group, "params": [names[int(i)] for i in group["params"]]})
    if sum(len(g["params"]) for g in groups) != len(names):
        raise InputError(
            f"The checkpoint's optimizer has {sum(len(g['params']) for g in groups)} parameters and this run's has "
            f"{len(names)}. Received: a checkpoint of another model or optimizer. Build the same model and optimizer "
            "as the run that wrote it, or remove the checkpoint to start afresh."
        )
    return {"state": {names[int(i)]: dict(entry) for i, entry in positions.items()}, "param_groups": groups}
