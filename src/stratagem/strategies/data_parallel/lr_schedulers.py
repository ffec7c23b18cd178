"""LR schedulers on a distributed optimizer: one step per global step, wherever `step()` is called.

A training step written for one device calls `scheduler.step()` after `optimizer.step()`; inside
`Strategy.run` that line runs once per replica thread, on the one scheduler object, which would
then count N steps per global step and follow another schedule. So a scheduler built on the
optimizer `distribute` returned is adopted by it: inside `run` the replicas meet at
`scheduler.step()`, replica 0 executes it once, the hyper-parameters it wrote are copied to every
replica, then all continue. Outside `run` it steps as usual. The scheduler's own object, class and
`state_dict()` stay those of torch, so `get_last_lr()` and checkpoints read as on one device.

How a scheduler is found: every torch scheduler reads `optimizer.param_groups` while it is built
(`LRScheduler.__init__`, and also `SequentialLR`, `ChainedScheduler` and `ReduceLROnPlateau`,
which do not call it), so the distributed optimizer's `param_groups` looks, outside `run`, for a
scheduler among its few calling frames. torch offers no hook for this (a scheduler only wraps
`optimizer.step`, and not all of them do), and the frames are the one place that names the
scheduler without scanning every object of the process.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from stratagem.errors import InputError

if TYPE_CHECKING:
    from types import FrameType

_local = threading.local()
_CALLER_FRAMES = 4
"""How far up from `param_groups` a scheduler's constructor may be (ReduceLROnPlateau reads the groups
through torch's helper `_param_groups_val_list`, two frames below its `__init__`)."""
_OWN_ATTRIBUTES = ("step", "state_dict")
"""What adoption sets on a scheduler instance (and keeps out of its `state_dict()`)."""


class SchedulerHost(Protocol):
    """What a distributed optimizer offers the schedulers built on it."""

    _schedulers: SchedulerSet

    def _current_replica(self) -> int | None: ...

    def _meet(self, replica: int, what: str) -> None: ...

    def _publish_hyperparameters(self) -> None: ...


class SchedulerSet:
    """The schedulers a distributed optimizer has adopted (held weakly: a dropped scheduler goes)."""

    def __init__(self) -> None:
        self._members: weakref.WeakSet[LRScheduler] = weakref.WeakSet()

    def __contains__(self, scheduler: object) -> bool:
        return scheduler in self._members

    def add(self, scheduler: LRScheduler) -> None:
        self._members.add(scheduler)


def drives(scheduler: Any, optimizer: Any) -> bool:
    """Whether `scheduler` adjusts `optimizer`: built on it, or on the optimizer given to `distribute`
    when `optimizer` is what `distribute` returned (which then adopted it)."""
    adopted = getattr(optimizer, "_schedulers", None)
    return scheduler.optimizer is optimizer or (isinstance(adopted, SchedulerSet) and scheduler in adopted)


def executing() -> bool:
    """Whether this thread is executing a scheduler step on behalf of every replica."""
    return getattr(_local, "executing", False)


def adopt_calling_scheduler(host: SchedulerHost) -> None:
    """Adopts the scheduler whose code (a few frames up) is reading `host.param_groups`, if any."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return
        candidate = frame.f_locals.get("self")
        # Every torch scheduler sets its `optimizer` before it first reads the groups.
        if isinstance(candidate, LRScheduler) and getattr(candidate, "optimizer", None) is host:
            if candidate not in host._schedulers:
                adopt(candidate, host)
            return
        frame = frame.f_back


def adopt(scheduler: LRScheduler, host: SchedulerHost) -> None:
    """Makes `scheduler.step()` run once per global step for the replicas of `host` (see the module)."""
    host._schedulers.add(scheduler)
    original_step: Callable[..., Any] = scheduler.step
    original_state_dict: Callable[[], dict[str, Any]] = scheduler.state_dict
    host_ref = weakref.ref(host)
    plateau = isinstance(scheduler, ReduceLROnPlateau)
    name = type(scheduler).__name__

    def step(*args: Any, **kwargs: Any) -> Any:
        owner = host_ref()
        replica = None if owner is None or executing() else owner._current_replica()
        if replica is None:  # outside run, or inside a scheduler step already executed for all (SequentialLR's)
            return _execute(owner, original_step, args, kwargs)
        if plateau:
            raise InputError(
                f"{name}.step(metric) ran inside strategy.run(), where each replica holds the metric of its own "
                f"slice of the batch only, so the schedule would follow replica 0's slice. Received: step() called "
                f"by replica {replica}. Call scheduler.step(metric) outside strategy.run(), with the metric over the "
                "global batch (e.g. strategy.reduce('mean', losses))."
            )
        assert owner is not None  # replica is None when the owner is gone
        owner._meet(replica, "scheduler step")
        result = _execute(owner, original_step, args, kwargs) if replica == 0 else None
        owner._meet(replica, "end of the scheduler step")  # nobody reads the hyper-parameters half-written
        return result

    def state_dict() -> dict[str, Any]:
        state = original_state_dict()
        for key in _OWN_ATTRIBUTES:
            state.pop(key, None)
        return state

    # Instance attributes, as torch's own LRScheduler does with `optimizer.step`: the scheduler keeps its
    # class, and its state_dict() leaves these out, so a checkpoint loads into a plain scheduler.
    scheduler.step = step  # type: ignore[method-assign]
    scheduler.state_dict = state_dict  # type: ignore[method-assign]


def _execute(owner: SchedulerHost | None, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    previous = executing()
    _local.executing = True  # the optimizer shows the primary groups; nested schedulers step directly
    try:
        result = step(*args, **kwargs)
        if owner is not None:
            owner._publish_hyperparameters()
        return result
    finally:
        _local.executing = previous


def adopt_existing(optimizer: Any, host: SchedulerHost, referrers: Callable[[Any], list[Any]]) -> None:
    """Adopts the schedulers already built on `optimizer` (the user's, before `distribute`) for `host`.

    Only when torch's scheduler left its mark on `optimizer.step` (every `LRScheduler` that calls its
    base `__init__`, the parts of a `SequentialLR` among them): looking through `referrers` (the
    garbage collector's) costs about 0.1 s, too much for every `distribute`.
    """
    step = vars(optimizer).get("step")
    if step is None or not hasattr(step, "_wrapped_by_lr_sched"):
        return
    for candidate in referrers(optimizer):
        if isinstance(candidate, LRScheduler) and getattr(candidate, "optimizer", None) is optimizer:
            adopt(candidate, host)
    # SequentialLR and ChainedScheduler refer to the optimizer too, and step their parts themselves.
