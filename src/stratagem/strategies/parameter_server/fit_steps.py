"""How `sg.fit` runs under the parameter server: its steps scheduled on the workers.

`fit` builds its step functions inside itself (closures over the model, the loss and the
metrics), so they have no module-level name a worker in another process could look up. But every
task runs the same script, so every task reaches the same `fit` call and builds the same step
functions. `fit` hands them, by role ("train", "eval"), to `prepare_fit_steps`:

- on a worker task they are kept in this process, and the worker starts serving (it exits when
  the chief ends the job, as at the first `coordinator.schedule`);
- on the chief, `fit_steps` schedules, for each global batch, `run_fit_step(role, inputs, targets)`,
  a module-level function every worker finds by name, which runs that worker's own step for the
  role on its replica (pulling the current parameters, pushing the gradients).

At most `WINDOW_PER_WORKER` steps per worker are in flight, so workers stay busy while the chief
reads the next batches; each step's metric state comes back to `on_step` in the order of the
batches. Updates are asynchronous, as everywhere under this strategy: a step computes its gradient
on the parameters it pulled, which other workers' steps may have changed since.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError, ParameterServerError

if TYPE_CHECKING:
    from stratagem.strategies.parameter_server.coordinator import ClusterCoordinator
    from stratagem.strategies.parameter_server.tasks import ParameterServerTasks

StepFn = Callable[[Any, Any], torch.Tensor]

WINDOW_PER_WORKER = 2
"""Steps in flight per worker: one running, one queued, so a worker never waits for the chief."""

_steps: dict[str, tuple[StepFn, Any]] = {}
"""This process's fit step functions by role, with the model they train (its mode is set per role)."""
_lock = threading.Lock()


def run_fit_step(role: str, inputs: Any, targets: Any) -> torch.Tensor:
    """Runs this worker's `fit` step for `role` on one global batch (scheduled by the chief, by name)."""
    with _lock:
        entry = _steps.get(role)
    if entry is None:
        raise ParameterServerError(
            f"This worker has no fit step for {role!r}. Received: steps for {sorted(_steps)}. Run the same "
            "script on every task, so that every worker reaches the same sg.fit call as the chief."
        )
    step, model = entry
    model.train(role == "train")  # the worker's own replica: the chief's mode does not reach it
    return step(inputs, targets)


def prepare_fit_steps(strategy: ParameterServerTasks, steps: Mapping[str, StepFn], model: Any) -> None:
    """Keeps `fit`'s step functions for the workers of this process; on a worker task, serves (never returns)."""
    for role, step in steps.items():
        if not callable(step):
            raise InputError(f"A fit step must be callable. Received: {role}={step!r}. Report this as a bug.")
    with _lock:
        _steps.update({role: (step, model) for role, step in steps.items()})
    if not strategy.tasks.is_coordinator:
        strategy.serve_as_worker()  # raises SystemExit when the chief ends the job


def fit_steps(
    coordinator: ClusterCoordinator, step_fn: StepFn, batches: Iterable[Any], on_step: Callable[[torch.Tensor], None]
) -> None:
    """The chief's step loop for `fit` (the contract of `stratagem.train.loop.run_steps_synchronously`).

    `fit`'s own steps are scheduled on the workers. Any other step function (`sg.evaluate` after
    training, say) has no counterpart on the workers, so it runs here on the chief, on the chief's
    copy of the model refreshed from the parameter servers (tf.distribute's inline evaluation).
    """
    with _lock:
        role = next((name for name, (step, _) in _steps.items() if step is step_fn), None)
    if role is None:
        coordinator.join()  # every scheduled update lands before the chief reads the parameters
        model = coordinator.strategy.distributed_model
        if model is None:
            raise InputError(
                "A step ran before strategy.distribute(model, optimizer). Received: no model. "
                "Distribute the model first (sg.fit does it for you)."
            )
        model.pull()
        for index, batch in enumerate(batches):
            _check_pair(index, batch)
            on_step(step_fn(batch[0], batch[1]).detach().to("cpu", torch.float64))
        return
    window = WINDOW_PER_WORKER * max(1, coordinator.num_workers)
    pending: collections.deque[Any] = collections.deque()
    try:
        for index, batch in enumerate(batches):
            _check_pair(index, batch)
            pending.append(coordinator.schedule(run_fit_step, args=(role, batch[0], batch[1])))
            if len(pending) >= window:
                on_step(_state(pending.popleft()))
        while pending:
            on_step(_state(pending.popleft()))
    except BaseException:
        # A failed step, bad input or a callback that stops training: let what is in flight land
        # before the error leaves, so nothing still changes the parameters behind the caller's back.
        with contextlib.suppress(Exception):
            coordinator.join()
        raise
    coordinator.join()


def _check_pair(index: int, batch: Any) -> None:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InputError(
            f"Batch {index} is not an (inputs, targets) pair. Received: {type(batch).__name__}. Make the "
            "loader yield (x, y) tuples, e.g. DataLoader(TensorDataset(x, y), batch_size=64)."
        )


def _state(value: Any) -> torch.Tensor:
    return value.fetch().detach().to("cpu", torch.float64)
