"""LR schedulers on a distributed optimizer: one step per global step, wherever `step()` is called.

A training step written for one device calls `scheduler.step()` after `optimizer.step()`; inside
`Strategy.run` that line runs once per replica thread, on the one scheduler object, which would
then count N steps per global step and follow another schedule. So the scheduler is handed over:

    >>> model, optimizer = strategy.distribute(model, optimizer)
    >>> scheduler = strategy.distribute_scheduler(StepLR(optimizer, 2))  # or one built before distribute

`distribute_scheduler` returns a `DistributedScheduler`, stratagem's own object around the user's
scheduler (which is left as it is: same class, same methods). Inside `run` the replicas meet at its
`step()`, replica 0 steps the user's scheduler once, the hyper-parameters it wrote are copied to
every replica, then all continue. Outside `run` it steps the user's scheduler directly. Its
`state_dict()`, `get_last_lr()` and every other attribute are the user's scheduler's.

A scheduler that was not handed over cannot be stepped once per global step inside `run`, so it is
refused there (`HyperparameterWatch`), found by its writes, without touching the scheduler:
- one built on the distributed optimizer writes through that optimizer's `param_groups`, which,
  inside `run`, are views of stratagem's (`GroupView`): a write there is refused at once;
- one built on the user's optimizer before `distribute` writes the user's groups, whose
  hyper-parameters are compared at the end of every `run` with those at its start: a change no
  handed-over scheduler made is refused then (the first step in which the scheduler changes a value).
Stepped outside `run`, such a scheduler steps once per global step and is left alone.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim.lr_scheduler import ReduceLROnPlateau

from stratagem.errors import InputError

if TYPE_CHECKING:
    from stratagem.strategies.replica_context import ReplicaMeeting

_local = threading.local()

_NOT_HANDED_OVER_FIX = (
    "Hand the scheduler to the strategy, `scheduler = strategy.distribute_scheduler(scheduler)`, and step "
    "what it returns (it steps yours once per global step, inside or outside strategy.run()), or step the "
    "scheduler after strategy.run() returns."
)
_NOT_FIRST_STEP = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


class SchedulerHost(Protocol):
    """What a distributed optimizer offers the schedulers handed over for it."""

    @property
    def primary_optimizer(self) -> Any:
        """The optimizer whose groups hold the hyper-parameters (the one given to `distribute`)."""

    @property
    def has_stepped(self) -> bool:
        """Whether `step()` has run at least once."""

    @property
    def meeting(self) -> ReplicaMeeting:
        """The replicas' host: which replica runs on this thread, and where they meet."""

    def publish_hyperparameters(self) -> None:
        """Copies the primary groups' hyper-parameters to every replica's optimizer (after a scheduler step)."""


def executing() -> bool:
    """Whether this thread is executing a handed-over scheduler's step on behalf of every replica."""
    return getattr(_local, "executing", False)


def drives(scheduler: Any, optimizer: Any) -> bool:
    """Whether `scheduler` adjusts `optimizer`: built on it, or on the optimizer given to `distribute`
    when `optimizer` is what `distribute` returned."""
    target = scheduler.optimizer
    return target is optimizer or target is getattr(optimizer, "primary_optimizer", None)


def check_scheduler(scheduler: Any) -> None:
    """Raises `InputError` unless `scheduler` looks like a torch LR scheduler."""
    if isinstance(scheduler, DistributedScheduler):
        raise InputError(
            "This scheduler was already handed to a strategy. Received: a DistributedScheduler around "
            f"{type(scheduler.scheduler).__name__}. Step the object distribute_scheduler() returned; hand over "
            "each scheduler once."
        )
    if not (callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "optimizer")):
        raise InputError(
            "distribute_scheduler() needs a torch.optim.lr_scheduler scheduler (an object with `optimizer` and "
            f"`step()`). Received: {type(scheduler).__name__}. Pass e.g. torch.optim.lr_scheduler.StepLR(optimizer, 10)."
        )


class DistributedScheduler:
    """What `strategy.distribute_scheduler` returns: the user's scheduler, stepped once per global step.

    Inside `Strategy.run` every replica calls `step()`; they meet there, replica 0 steps the user's
    scheduler, its new rates reach every replica, then all continue. Outside `run`, `step()` steps it
    directly. Every other attribute (`get_last_lr()`, `last_epoch`, `state_dict()`, ...) is the user's
    scheduler's, so a checkpoint of it loads into a plain scheduler.
    """

    def __init__(self, scheduler: Any, host: SchedulerHost | None) -> None:
        check_scheduler(scheduler)
        if host is not None and not drives(scheduler, host):
            raise InputError(
                "The scheduler adjusts an optimizer that this strategy did not distribute. Received: a "
                f"{type(scheduler).__name__} of a {type(scheduler.optimizer).__name__}. Build it on the optimizer "
                "given to strategy.distribute() or on the one it returned."
            )
        self._scheduler = scheduler
        self._host = host

    @property
    def scheduler(self) -> Any:
        """The user's scheduler."""
        return self._scheduler

    @property
    def optimizer(self) -> Any:
        """The optimizer the user's scheduler was built on."""
        return self._scheduler.optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        host = self._host
        replica = None if host is None or executing() else host.meeting.current_replica()
        if replica is None:  # outside run, one replica thread, or within a scheduler step executed for all
            return self._execute(args, kwargs)
        if isinstance(self._scheduler, ReduceLROnPlateau):
            raise InputError(
                f"{type(self._scheduler).__name__}.step(metric) ran inside strategy.run(), where each replica holds "
                f"the metric of its own slice of the batch only, so the schedule would follow replica 0's slice. "
                f"Received: step() called by replica {replica}. Call scheduler.step(metric) outside strategy.run(), "
                "with the metric over the global batch (e.g. strategy.reduce('mean', losses))."
            )
        assert host is not None  # replica is None without a host
        host.meeting.meet(replica, "scheduler step")
        result = self._execute(args, kwargs) if replica == 0 else None
        host.meeting.meet(replica, "end of the scheduler step")  # nobody reads the hyper-parameters half-written
        return result

    def _execute(self, args: tuple, kwargs: dict) -> Any:
        host = self._host
        previous = executing()
        _local.executing = True  # the optimizer shows the primary groups; a nested scheduler's writes are ours
        try:
            with warnings.catch_warnings():
                if host is not None and host.has_stepped:
                    # torch's check that optimizer.step() ran first reads a flag its wrapper of the user's
                    # optimizer.step sets; where replicas step copies of that optimizer instead (shared
                    # parameters) the flag stays unset and the warning would be false. The other replica
                    # threads wait at the meeting meanwhile, so the filter is this thread's alone.
                    warnings.filterwarnings("ignore", message=_NOT_FIRST_STEP)
                result = self._scheduler.step(*args, **kwargs)
            if host is not None:
                host.publish_hyperparameters()
            return result
        finally:
            _local.executing = previous

    def state_dict(self) -> dict[str, Any]:
        return self._scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("_scheduler", "_host"):
            raise AttributeError(name)
        return getattr(self._scheduler, name)

    def __repr__(self) -> str:
        return f"DistributedScheduler({self._scheduler!r})"


def distribute_scheduler(scheduler: Any, host: SchedulerHost | None, given: Any) -> DistributedScheduler:
    """`scheduler` handed over for `host` (the distributed optimizer; None where the user's optimizer was
    returned as it is, one replica thread stepping it); `given` is the optimizer `distribute` received."""
    check_scheduler(scheduler)
    if host is None and given is not None and scheduler.optimizer is not given:
        raise InputError(
            "The scheduler adjusts an optimizer that this strategy did not distribute. Received: a "
            f"{type(scheduler).__name__} of a {type(scheduler.optimizer).__name__}. Build it on the optimizer "
            "given to strategy.distribute() or on the one it returned."
        )
    return DistributedScheduler(scheduler, host)


def _hyperparameters(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


class HyperparameterWatch:
    """Refuses hyper-parameter writes inside `run` that no handed-over scheduler made (see the module)."""

    def __init__(self, primary_groups: Callable[[], Sequence[dict[str, Any]]]) -> None:
        self._groups = primary_groups
        self._expected: list[dict[str, Any]] | None = None

    def begin_run(self) -> None:
        self._expected = _hyperparameters(self._groups())

    def accept(self) -> None:
        """The primary groups as they are now are stratagem's doing (a handed-over scheduler stepped)."""
        if self._expected is not None:
            self._expected = _hyperparameters(self._groups())

    def end_run(self) -> None:
        expected, self._expected = self._expected, None
        if expected is None:
            return
        now = _hyperparameters(self._groups())
        for index, (before, after) in enumerate(zip(expected, now)):
            changed = sorted(k for k in set(before) | set(after) if before.get(k, None) != after.get(k, None))
            if changed:
                key = changed[0]
                raise InputError(
                    "A hyper-parameter of the optimizer given to strategy.distribute() changed inside "
                    "strategy.run(), and no scheduler handed to the strategy changed it: a scheduler built on that "
                    "optimizer and stepped in the step function steps once per replica, so it would count N steps "
                    f"per global step. Received: param_groups[{index}][{key!r}] went from {before.get(key)!r} to "
                    f"{after.get(key)!r} during one run. {_NOT_HANDED_OVER_FIX} The scheduler "
                    "has counted those extra steps: build it again."
                )

    def view(self, groups: Sequence[dict[str, Any]], replica: int) -> list[GroupView]:
        return [GroupView(group, index, replica) for index, group in enumerate(groups)]


class GroupView(MutableMapping[str, Any]):
    """One replica's parameter group as the distributed optimizer shows it inside `run`: reads pass through;
    a hyper-parameter written there, by a scheduler that was not handed over or by the step function, would
    be written once per replica, so it is refused (see the module)."""

    def __init__(self, group: dict[str, Any], index: int, replica: int) -> None:
        self._group = group
        self._index = index
        self._replica = replica

    def __getitem__(self, key: str) -> Any:
        return self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not executing():
            raise InputError(
                "A hyper-parameter was written on the distributed optimizer inside strategy.run(), where every "
                "replica runs the step function: a scheduler stepped there would count one step per replica. "
                f"Received: param_groups[{self._index}][{key!r}] = {value!r:.60} by replica {self._replica}. "
                f"{_NOT_HANDED_OVER_FIX} To set a rate by hand, set it on optimizer.param_groups outside "
                "strategy.run()."
            )
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        raise InputError(
            "A parameter group's entry cannot be removed inside strategy.run(). "
            f"Received: del param_groups[{self._index}][{key!r}]. Change the groups outside strategy.run()."
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return repr(self._group)
