"""Strategies by their command-line name: what ``stratagem train --strategy NAME``, ``stratagem launch
--strategy NAME`` and `sg.strategy_from_env` (``STRATAGEM_STRATEGY=NAME``) build, over which devices, and why.

These are library, not demo: a script run under `stratagem launch --strategy NAME` gets the same
strategy over the same default devices as the digits demo of ``stratagem train --strategy NAME``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stratagem.devices import DeviceRegistry, default_registry
from stratagem.diagnose import PlacementDecision
from stratagem.errors import DeviceError, InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.explain import Explanation
from stratagem.strategies.records import STRATEGIES

if TYPE_CHECKING:
    from stratagem.strategies.tensor_parallel.mesh import LayoutMap

TENSOR_PARALLEL = "tensor_parallel"
"""The strategy that takes a layout map."""

STRATEGY_NAMES = STRATEGIES.names
"""The strategies that can be built by name, by their command-line name (`records.STRATEGIES`)."""


def build_strategy(
    name: str,
    devices: Sequence[str] | None = None,
    *,
    registry: DeviceRegistry | None = None,
    layout_map: LayoutMap | None = None,
) -> tuple[Strategy, PlacementDecision]:
    """The strategy ``name`` over ``devices``, or over the devices chosen for this machine, and why.

    Without devices, each strategy's record chooses (`StrategyRecord.default_devices`): ``mirrored``
    uses every GPU, or on a machine without one two logical CPU replicas (one if the CPU has a single
    logical device); ``one_device`` uses ``cuda:0`` when a GPU is visible, else ``cpu:0``.

    Example:
        >>> strategy, decision = build_strategy("mirrored", ["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync, decision.reason
        (2, 'given by --devices')

    ``layout_map`` (an `sg.LayoutMap`) goes to ``tensor_parallel``, which without one replicates every parameter;
    with any other name it is refused.

    Raises:
        InputError: ``name`` is not one of `STRATEGY_NAMES`, or a layout map came with another strategy.
        DeviceError: a device is unknown or unavailable, or ``one_device`` was given several.
    """
    registry = registry or default_registry
    if name not in STRATEGIES:
        raise InputError(f"Unknown strategy. Received: {name!r}. Choose one of {', '.join(STRATEGY_NAMES)}.")
    record = STRATEGIES[name]
    if layout_map is not None and name != TENSOR_PARALLEL:
        raise InputError(
            f"A layout map is applied by the {TENSOR_PARALLEL} strategy only. Received: strategy {name!r} with a "
            f"layout map. Use {TENSOR_PARALLEL}, or leave the layout map out."
        )
    if devices is not None:
        names = list(devices)
        if record.max_devices == 1 and len(names) != 1:
            raise DeviceError(
                f"The {name} strategy runs on exactly one device. Received: devices={names}. "
                "Name one device (e.g. --devices cuda:0) or use --strategy mirrored for several."
            )
        decision = PlacementDecision(subject="devices", choice=", ".join(names), reason="given by --devices")
    else:
        names, decision = record.default_devices(name, registry)
    if layout_map is not None:
        from stratagem.strategies.tensor_parallel.strategy import TensorParallelStrategy

        return TensorParallelStrategy(layout_map, device=names[0]), decision
    return record.build(names, registry), decision


def explain_built(strategy: Strategy, decision: PlacementDecision) -> Explanation:
    """``strategy.explain()`` of a strategy `build_strategy` built, with its devices decision the one
    `build_strategy` made: the strategy itself was handed its devices (``devices=``) and cannot know whether
    ``--devices`` named them or the machine chose them.

    Example:
        >>> strategy, decision = build_strategy("mirrored")
        >>> explain_built(strategy, decision).decision("devices").reason   # doctest: +SKIP
        'no usable GPU: ... So 2 logical CPU replica(s) ...'
    """
    explanation = strategy.explain()
    decisions = [
        dataclasses.replace(d, reason=decision.reason) if d.subject == "devices" else d for d in explanation.decisions
    ]
    return dataclasses.replace(explanation, decisions=decisions)
