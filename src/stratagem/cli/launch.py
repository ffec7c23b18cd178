"""``stratagem launch``: run a script as a local cluster, one process per task.

    stratagem launch --workers 2 train.py --epochs 3
    stratagem launch --workers 2 --ps 1 --max-restarts 1 --timeout 600 -m mypackage.train
    stratagem launch --strategy mirrored train.py       # one process; sg.strategy_from_env() builds it

Worker 0 is the chief. Every output line is prefixed with its task (``[worker:1] ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from stratagem import environ
from stratagem.cluster.attempt import StopRequest
from stratagem.cluster.launch import LaunchResult, launch
from stratagem.cluster.processes import OutputLine
from stratagem.errors import StratagemError
from stratagem.strategies.records import STRATEGIES
from stratagem.trace.merge import merge

# From the strategy records, which import neither torch nor any strategy: the launcher starts its tasks
# without them (tests/test_launch_startup.py).
STRATEGY_NAMES = STRATEGIES.names
ONE_PROCESS_STRATEGIES = tuple(record.name for record in STRATEGIES if not record.one_process_per_worker)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="run a script as a local cluster (workers, parameter servers) on this machine",
        description=(
            "Start one process per task on 127.0.0.1 with free ports, set TF_CONFIG and torchrun's "
            "variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for "
            "each, prefix each output line with its task, and stop everything at the first failure. "
            "Worker 0 is the chief. With --ps, a worker other than the chief that dies is restarted alone "
            "(--max-restarts times) or left out while the job goes on."
        ),
    )
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="number of worker processes (default 1)")
    parser.add_argument(
        "--strategy",
        choices=STRATEGY_NAMES,
        metavar="NAME",
        help="the strategy sg.strategy_from_env() builds in each task (exported as STRATAGEM_STRATEGY): "
        f"one of {', '.join(STRATEGY_NAMES)}; by default multi_worker for several workers",
    )
    parser.add_argument(
        "--devices-per-worker",
        type=int,
        metavar="K",
        help="devices each worker uses (exported as STRATAGEM_DEVICES_PER_WORKER)",
    )
    parser.add_argument("--ps", type=int, default=0, metavar="P", help="number of parameter-server processes")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole group at most R times when a task fails (sets STRATAGEM_RESTART_COUNT); "
        "with --ps, a worker other than the chief is restarted alone, at most R times each",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop everything and fail (exit 124) if the run takes longer than S seconds",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping tasks (default 5)",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc at its defaults; by default the tasks keep freed memory for reuse and ask "
        "for huge pages where the kernel gives them on request (GLIBC_TUNABLES), which spares a CPU training "
        "step thousands of page faults",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="trace every step of every worker (exported as STRATAGEM_TRACE); each worker writes DIR/worker-<rank>.json "
        "and the launcher merges them into DIR/trace.json.gz for Perfetto (see `stratagem trace summary DIR`)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m")
    mode.add_argument("--no-python", action="store_true", help="SCRIPT is an executable, run without python")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module, or executable)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    return parser


def _command(args: argparse.Namespace) -> list[str]:
    if args.module:
        return [sys.executable, "-m", args.script, *args.script_args]
    if args.no_python:
        return [args.script, *args.script_args]
    return [sys.executable, args.script, *args.script_args]


def _print_line(line: OutputLine) -> None:
    stream = sys.stdout if line.stream == "stdout" else sys.stderr
    print(f"[{line.task}] {line.text}", file=stream, flush=True)


# A scheduler's SIGTERM and a Ctrl-C stop the launch the same way (exit code 128 + the signal's number).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """A `StopRequest` installed as the handler of SIGTERM and SIGINT while the block runs; pass it to `launch`.

    Tasks run in their own sessions, so a scheduler's SIGTERM (or a Ctrl-C) reaches only the launching process. The
    handler only asks launch() to stop (see StopRequest: raising there could leave a task started and never
    stopped); launch() then stops every task (SIGTERM, so a task under BackupAndRestore backs up) and returns. A
    signal this process ignores stays ignored. Every command that starts tasks (`stratagem launch`, `stratagem
    train --workers N`) goes through here.
    """
    stop = StopRequest()
    previous = {
        signum: signal.signal(signum, stop.request)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) != signal.SIG_IGN
    }
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stopped_by_signal(stop: StopRequest, result: LaunchResult) -> bool:
    """Whether the launch ended because `stop` was requested (and not by a task's own failure before it)."""
    return stop.signum is not None and result.failed_task is None and result.exit_code == 128 + stop.signum


def stop_message(stop: StopRequest, result: LaunchResult, backup_dir: str | None) -> str:
    """What `stratagem train` says when a signal stopped the job it launched: which signal, and where the backup is."""
    signum = stop.signum or signal.SIGTERM
    how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"received {signal.Signals(signum).name}"
    said = f"{how}; stopped every task (exit code {result.exit_code})."
    if not backup_dir:
        return f"{said} No --backup-dir was given, so nothing was backed up: a rerun starts afresh."
    from stratagem.train.backup.report import newest_whole_backup

    newest = newest_whole_backup(backup_dir)
    if newest is None:
        # Either the stop came before the first backup, or after training had finished and removed its backups
        # (a signal in the moments between the last step and the exit): from here the two look alike.
        return (
            f"{said} No whole backup is in {backup_dir}: the stop came before the first one, or after training had "
            "finished and removed them. A rerun starts afresh."
        )
    where = "" if newest.step is None else f" (step {newest.step}, epoch {newest.epoch})"
    return f"{said} The backup is {newest.path}{where}: rerun the same command to resume from it."


def _environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(environ.current())
    if args.trace:
        env[environ.TRACE] = str(Path(args.trace).resolve())  # the tasks may start in another directory
    return env


def _merge_trace(directory: str) -> None:
    try:
        path = merge(directory)
    except (StratagemError, OSError, ValueError) as error:  # no worker wrote its file (a failed run), or a torn one
        print(f"stratagem launch: no trace merged from {directory}: {error}", file=sys.stderr)
        return
    print(f"stratagem launch: trace written to {path}; open it at https://ui.perfetto.dev", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if not (args.module or args.no_python) and not Path(args.script).is_file():
        print(
            f"stratagem launch: error: no such script. Received: {args.script!r}. "
            "Give the path of a Python file, or use -m for a module.",
            file=sys.stderr,
        )
        return 2
    if args.no_python and shutil.which(args.script) is None:
        print(
            f"stratagem launch: error: no such executable. Received: --no-python {args.script!r}. Give the "
            "path of an executable file (chmod +x), or a command on PATH.",
            file=sys.stderr,
        )
        return 2
    if args.strategy in ONE_PROCESS_STRATEGIES and (args.workers > 1 or args.ps > 0):
        print(
            f"stratagem launch: error: --strategy {args.strategy} trains in one process, so each of the "
            f"{args.workers + args.ps} tasks would train its own model. Received: --strategy {args.strategy} "
            f"--workers {args.workers} --ps {args.ps}. Use --strategy multi_worker (or parameter_server with "
            "--ps), or --workers 1.",
            file=sys.stderr,
        )
        return 2
    try:
        with stop_on_signals() as stop:
            result = launch(
                _command(args),
                workers=args.workers,
                env=_environment(args),
                sink=_print_line,
                ps=args.ps,
                devices_per_worker=args.devices_per_worker,
                max_restarts=args.max_restarts,
                timeout=args.timeout,
                grace_period=args.grace_period,
                keep_freed_memory=not args.default_allocator,
                strategy=args.strategy,
                stop=stop,
            )
    except StratagemError as exc:
        print(f"stratagem launch: error: {exc}", file=sys.stderr)
        return 2
    if stop.signum is not None and stopped_by_signal(stop, result):
        if stop.signum == signal.SIGINT:
            print("stratagem launch: interrupted (Ctrl-C); stopped.", file=sys.stderr)  # as every command says it
        else:
            print(
                f"stratagem launch: received {signal.Signals(stop.signum).name}; stopped every task "
                f"(exit code {result.exit_code})",
                file=sys.stderr,
            )
        return result.exit_code
    if args.trace:
        _merge_trace(args.trace)
    if result.ok:
        if result.restarts or result.recoveries:
            print(f"stratagem launch: {result.explain()}", file=sys.stderr)
        return 0
    print(
        f"stratagem launch: {result.failed_task or 'launch'} {result.reason}; "
        f"stopped the other tasks (exit code {result.exit_code})",
        file=sys.stderr,
    )
    for failure in result.failures[:-1]:
        print(
            f"stratagem launch: restarted after attempt {failure.attempt}: {failure.task} {failure.reason}",
            file=sys.stderr,
        )
    return result.exit_code
