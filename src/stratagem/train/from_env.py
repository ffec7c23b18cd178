"""`strategy_from_env`: the strategy a script's launch asks for, so the script is the same in every launch mode.

Resolution, first match wins:

1. ``STRATAGEM_STRATEGY`` names a strategy (`stratagem launch --strategy NAME` sets it; any of
   `STRATEGY_NAMES`), over the devices in ``STRATAGEM_DEVICES`` (comma-separated, ``cpu:0,cpu:1``)
   or the defaults of ``stratagem train --strategy NAME``;
2. a cluster of several processes (TF_CONFIG, torchrun's variables, SLURM's; `stratagem launch
   --workers N` sets the first two): the first strategy of one process per worker that needs
   parameter servers (`ParameterServerStrategy`) when TF_CONFIG names some, else the first that
   needs none (`MultiWorkerMirroredStrategy`), in the order of `records.STRATEGIES`;
3. otherwise one process: `MirroredStrategy()` over every visible GPU, or the CPU (and its
   `explain()` says why).

A strategy of one process named while the environment describes several processes is refused:
each process would train a model of its own, silently.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from stratagem import environ
from stratagem.cluster import resolve_cluster
from stratagem.errors import InputError
from stratagem.strategies import LayoutMap, MirroredStrategy, Strategy, TensorParallelStrategy
from stratagem.strategies.by_name import STRATEGY_NAMES, TENSOR_PARALLEL, build_strategy
from stratagem.strategies.records import STRATEGIES

logger = logging.getLogger(__name__)

STRATEGY_VARIABLE = "STRATAGEM_STRATEGY"
DEVICES_VARIABLE = "STRATAGEM_DEVICES"


def strategy_from_env(env: Mapping[str, str] | None = None, *, layout_map: LayoutMap | None = None) -> Strategy:
    """The strategy this process's environment asks for (see the module docstring for the order).

    ``env`` defaults to the process environment; tests pass their own. ``layout_map`` (a `sg.LayoutMap`) asks for
    tensor parallelism: `TensorParallelStrategy(layout_map)` where ``STRATAGEM_STRATEGY`` is unset or
    ``tensor_parallel``; any other strategy named with it is refused (combining them is not supported yet).

    Example:
        >>> strategy = sg.strategy_from_env()      # python train.py, stratagem launch, torchrun: same line
        >>> model, optimizer = strategy.distribute(model, optimizer)

    Raises:
        InputError: ``STRATAGEM_STRATEGY`` is not a known name, ``STRATAGEM_DEVICES`` is empty, or a
            one-process strategy was named in one of several processes.
    """
    env = environ.current() if env is None else env
    cluster = resolve_cluster(None, env=env)
    name = env.get(STRATEGY_VARIABLE, "").strip()
    devices = _devices(env)
    if layout_map is not None:
        return _tensor_parallel(name, layout_map, devices)
    if name:
        if name not in STRATEGY_NAMES:
            raise InputError(
                f"Unknown strategy. Received: {STRATEGY_VARIABLE}={name!r}. "
                f"Set it to one of {', '.join(STRATEGY_NAMES)}, or unset it to choose from the cluster."
            )
        if cluster.is_distributed and not STRATEGIES[name].one_process_per_worker:
            raise InputError(
                f"{STRATEGY_VARIABLE}={name} trains in one process, but this process is {cluster.task_name} of a "
                f"cluster of {cluster.world_size} (from {cluster.source}), so every process would train its own model. "
                f"Received: {STRATEGY_VARIABLE}={name!r}. Use multi_worker (or parameter_server), or start one process."
            )
        logger.info("strategy %s, as %s says", name, STRATEGY_VARIABLE)
        return build_strategy(name, devices)[0]
    if cluster.is_distributed:
        with_ps = bool(cluster.addresses.get("ps"))
        name = next(r.name for r in STRATEGIES if r.one_process_per_worker and r.parameter_servers == with_ps)
        logger.info(
            "strategy %s for %s of a cluster of %d (from %s)",
            name,
            cluster.task_name,
            cluster.world_size,
            cluster.source,
        )
        return build_strategy(name, devices)[0]
    logger.info("strategy mirrored over the visible GPUs or the CPU: one process, no %s", STRATEGY_VARIABLE)
    return MirroredStrategy(devices)


def _tensor_parallel(name: str, layout_map: LayoutMap, devices: list[str] | None) -> Strategy:
    if name not in ("", TENSOR_PARALLEL):
        raise InputError(
            f"A layout map is applied by the tensor_parallel strategy; {name} with a layout map is not supported yet. "
            f"Received: {STRATEGY_VARIABLE}={name!r} and layout_map=. Launch with --strategy tensor_parallel, or drop "
            "the layout map."
        )
    logger.info("strategy %s, for the layout map", TENSOR_PARALLEL)
    return TensorParallelStrategy(layout_map, device=None if devices is None else devices[0])


def _devices(env: Mapping[str, str]) -> list[str] | None:
    if DEVICES_VARIABLE not in env:
        return None
    names = [part.strip() for part in env[DEVICES_VARIABLE].split(",") if part.strip()]
    if not names:
        raise InputError(
            f"{DEVICES_VARIABLE} names no device. Received: {DEVICES_VARIABLE}={env[DEVICES_VARIABLE]!r}. "
            "Name devices separated by commas (cpu:0,cpu:1), or unset it for the defaults."
        )
    return names
