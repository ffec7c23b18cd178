"""`sg.launch`: run a Python function as a local cluster, from a script or a notebook.

    import stratagem as sg
    from mytraining import train           # a function importable by a new process

    results = sg.launch(train, workers=2, args=(3,), timeout=600)
    results[0]                             # the chief's return value

It is `stratagem launch` for a function: one process per task (the same environment: TF_CONFIG,
torchrun's variables, a token), every output line prefixed with its task, the first failure named
and the others stopped, an optional timeout. Each task runs ``fn(*args, **kwargs)`` in a fresh
interpreter (as multiprocessing's "spawn" does: nothing is forked, so CUDA and threads are safe),
and ``launch`` returns every worker's return value, in rank order.

What a new process can run: ``fn`` travels by reference (its module and name, as pickle sends a
function), so it must be defined at the top level of a module, or of the script that calls
``launch`` (which then needs the ``if __name__ == "__main__":`` guard, since each task imports the
script again). A lambda, a nested function, or a function typed into a notebook or an interactive
session cannot be found by another process: put it in a ``.py`` file and import it.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem import environ
from stratagem.cluster.launch import launch as launch_command
from stratagem.cluster.launch import launched_by_stratagem
from stratagem.cluster.processes import OutputLine, Sink
from stratagem.errors import ClusterError, InputError, LaunchError

PAYLOAD_NAME = "payload.pkl"
RUNNER_MODULE = "stratagem.cluster.run_function"


def result_path(directory: str | Path, task: str) -> Path:
    """Where the task ``task`` (``worker:1``) writes its pickled return value."""
    return Path(directory) / f"{task.replace(':', '-')}.result.pkl"


def _print_line(line: OutputLine) -> None:
    # The tasks' own output, relayed as `stratagem launch` relays it; the caller asked for it by launching.
    stream = sys.stdout if line.stream == "stdout" else sys.stderr
    stream.write(f"[{line.task}] {line.text}\n")
    stream.flush()


def _check_importable(fn: Callable[..., Any]) -> str | None:
    """The main script's path when ``fn`` lives in it; raises InputError when a new process cannot find ``fn``."""
    if not callable(fn):
        raise InputError(f"launch() needs a function to run in every task. Received: {type(fn).__name__}.")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", type(fn).__name__))
    fix = (
        "Define it at the top level of a .py module (e.g. train.py beside the notebook), "
        "import it (from train import main), and launch that."
    )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise InputError(
            f"A new process cannot find a lambda or a function defined inside another function. "
            f"Received: {module}.{qualname}. {fix}"
        )
    if module == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file is None:
            raise InputError(
                "The function was defined in a notebook or an interactive session, which a new process cannot "
                f"import. Received: __main__.{qualname}. {fix}"
            )
        return os.path.abspath(main_file)
    return None


def launch(
    fn: Callable[..., Any],
    *,
    workers: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    ps: int = 0,
    strategy: str | None = None,
    timeout: float | None = None,
    grace_period: float = 5.0,
    max_restarts: int = 0,
    devices_per_worker: int | None = None,
    sink: Sink | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` in every task of a local cluster; returns each worker's return value.

    The list holds one value per worker, in rank order (``[0]`` is the chief's); parameter servers'
    values are not returned. Output lines go to ``sink`` (default: this process's stdout and stderr,
    prefixed ``[worker:1] ``: library code does not print, but this relays the tasks' own output,
    which the caller asked for by launching, as `Strategy.print` is the caller's own print). ``strategy`` is exported as ``STRATAGEM_STRATEGY`` for
    `sg.strategy_from_env`; the other options are those of ``stratagem launch``.

    Example:
        >>> results = sg.launch(train, workers=2, args=(3,), timeout=600)   # doctest: +SKIP

    Raises:
        InputError: ``fn`` cannot be found by a new process (see the module docstring), or its
            arguments cannot be pickled.
        ClusterError: called inside a task of a launch, or bad launch options.
        LaunchError: a task failed or the timeout passed; the message names the task, ``.result``
            is the `LaunchResult`.
    """
    env = environ.current()
    if launched_by_stratagem(env):
        raise ClusterError(
            "launch() was called inside a task of a launch, so every task would start a cluster of its own. "
            f"Received: STRATAGEM_CLUSTER_TOKEN set, TF_CONFIG={env.get('TF_CONFIG', '')!r:.120}. When the "
            'function lives in the main script, call launch() under `if __name__ == "__main__":`.'
        )
    main_file = _check_importable(fn)
    try:
        call = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:  # pickle raises several kinds (PicklingError, TypeError, AttributeError)
        raise InputError(
            f"The function's arguments cannot be sent to a new process. Received: {error}. "
            "Pass values that pickle (tensors, numbers, strings, lists, dicts...)."
        ) from None
    with tempfile.TemporaryDirectory(prefix="stratagem-launch-") as directory:
        # Two layers: the task sets its import path and runs the main script before unpickling the call.
        payload = pickle.dumps({"sys_path": list(sys.path), "main_file": main_file, "call": call})
        (Path(directory) / PAYLOAD_NAME).write_bytes(payload)
        result = launch_command(
            [sys.executable, "-m", RUNNER_MODULE, directory],
            workers=workers,
            ps=ps,
            env=env,
            sink=sink or _print_line,
            timeout=timeout,
            grace_period=grace_period,
            max_restarts=max_restarts,
            devices_per_worker=devices_per_worker,
            strategy=strategy,
        )
        if not result.ok:
            raise LaunchError(
                f"{result.failed_task or 'launch'} {result.reason}; the other tasks were stopped. "
                f"Received: exit code {result.exit_code}. See the task's output above "
                f"(lines prefixed [{result.failed_task or 'worker:0'}]).",
                result,
            )
        return [pickle.loads(result_path(directory, f"worker:{rank}").read_bytes()) for rank in range(workers)]
