"""The parameter-server checkpoint: one file, independent of the placement that wrote it.

The file is a ``torch.save`` of ``{"format", "variables", "optimizer_state"}``, read back with
``weights_only=True`` after its checksums are checked (``stratagem.archive``). It holds whole
parameters (the shards of each put back together along dimension 0) and the optimizer state of
each parameter: per-row state (momentum, Adam's moments) is put back together the same way,
scalar state (Adam's step count) is taken from the first shard. So a checkpoint can be restored
under another partitioner or another number of parameter servers: ``shard_state`` cuts it again
for whatever placement is current.

These functions only compose and check values; ``ShardedVariables`` makes the calls that fetch
each server's part (``Save``) and hand it back (``Load``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stratagem.archive import load_verified
from stratagem.errors import InputError
from stratagem.strategies.parameter_server.partitioners import Shard, shard_of
from stratagem.strategies.parameter_server.server import STATE_SEPARATOR

CHECKPOINT_FORMAT = "stratagem.parameter_server/1"

Reply = tuple[str, Any, Mapping[str, torch.Tensor]]
"""One server's answer to ``Save``: operation, meta (its ``scalars`` by shard name) and tensors by name."""


def join_state(shards: Sequence[Shard], replies: Mapping[int, Reply]) -> dict[str, Any]:
    """The checkpoint of every parameter and its optimizer state, from each server's ``Save`` reply."""
    variables: dict[str, list[torch.Tensor]] = {}
    states: dict[str, dict[str, list[Any]]] = {}
    for shard in shards:
        _, meta, tensors = replies[shard.ps]
        variables.setdefault(shard.parameter, []).append(tensors[shard.name])
        state = states.setdefault(shard.parameter, {})
        prefix = f"{shard.name}{STATE_SEPARATOR}"
        for key, value in tensors.items():
            if key.startswith(prefix):
                state.setdefault(key[len(prefix) :], []).append(value)
        for key, value in meta["scalars"].get(shard.name, {}).items():
            state.setdefault(key, []).append(value)
    out_vars = {name: _join(parts) for name, parts in variables.items()}
    out_state = {
        name: {key: _join(parts) if _per_row(parts) else parts[0] for key, parts in state.items()}
        for name, state in states.items()
    }
    return {"format": CHECKPOINT_FORMAT, "variables": out_vars, "optimizer_state": out_state}


def check_covers(state: Mapping[str, Any], shards: Sequence[Shard]) -> None:
    """Raises ``InputError`` unless ``state`` holds every parameter that ``shards`` are cut from."""
    missing = sorted({s.parameter for s in shards} - set(state["variables"]))
    if missing:
        raise InputError(
            f"The checkpoint lacks parameters of this model. Received: missing {missing[:5]}. "
            "Restore a checkpoint written for this model."
        )


def shard_state(
    state: Mapping[str, Any], shards: Sequence[Shard]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """What one server's ``Load`` takes for ``shards``: their tensors (values and per-row state, cut to the
    shard's rows) by name, and their scalar optimizer state by shard name."""
    variables, opt_state = state["variables"], state["optimizer_state"]
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for s in shards:
        full = variables[s.parameter]
        tensors[s.name] = shard_of(full, s)
        for key, value in opt_state.get(s.parameter, {}).items():
            if isinstance(value, torch.Tensor):
                per_row = value.dim() > 0 and value.shape == full.shape
                tensors[f"{s.name}{STATE_SEPARATOR}{key}"] = shard_of(value, s) if per_row else value
            else:
                scalars.setdefault(s.name, {})[key] = value
    return tensors, scalars


def write(state: Mapping[str, Any], path: str | Path) -> None:
    """Writes ``state`` to ``path`` through a temporary file, so a crash leaves the old one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(dict(state), tmp)
    tmp.replace(path)


def read(path: str | Path) -> dict[str, Any]:
    """The checkpoint ``write`` wrote at ``path``, after checking the checksums of its archive.

    Raises:
        InputError: no file at ``path``, it holds objects other than tensors, or it is not a
            parameter-server checkpoint.
        CorruptCheckpointError: the file is damaged or torch cannot read it.
    """
    state = load_verified(path)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise InputError(
            f"Not a parameter-server checkpoint. Received: {str(path)!r} with format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}. "
            f"Pass a file written by ParameterServerStrategy.save."
        )
    if not all(isinstance(state.get(key), Mapping) for key in ("variables", "optimizer_state")):
        raise InputError(
            f"The parameter-server checkpoint {str(path)!r} lacks its variables or optimizer "
            f"state. Received: fields {sorted(map(str, state))[:10]}. Pass a file "
            "written by ParameterServerStrategy.save."
        )
    return state


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def _per_row(parts: list[Any]) -> bool:
    return all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts) and (
        len(parts) == 1 or len({p.shape[1:] for p in parts}) == 1
    )
