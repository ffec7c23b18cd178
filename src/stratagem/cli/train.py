"""``stratagem train``: train a small conv net on scikit-learn's digits, on every device it can use.

Shows where the work runs and why, a progress bar per epoch, loss and accuracy per epoch, then
the test accuracy, the training throughput and the devices. Without a GPU, the mirrored strategy
trains on two logical CPU replicas, so the gradient combination really runs.

Exit code: 0 when training finished, 2 for bad input (unknown device, bad option, an unwritable
--backup-dir; all checked before any work), 1 when training itself failed (a replica raised, a
wait timed out, scikit-learn is missing, a file could not be written), 143 on SIGTERM and 130 on
Ctrl-C (with --backup-dir: after a backup of the last step, which a rerun resumes from).

A job of several processes (--workers N, or --strategy parameter_server) runs under the local
launcher of ``stratagem launch``: a SIGTERM or Ctrl-C to this command is passed to every task, which
backs up and stops after the same step, and this command then says where the backup is.

With --json, standard output holds one JSON document, the chief's, whatever the strategy; under
the launcher the other tasks' lines go to standard error, prefixed with their task.

    $ stratagem train
    $ stratagem train --strategy one_device --devices cpu:0
    $ stratagem train --devices cpu:0,cpu:1 --epochs 5 --json
    $ stratagem train --backup-dir /tmp/digits-backup     # rerun the same command after a crash to resume
    $ stratagem train --strategy multi_worker --workers 2 --trace traces/   # then: stratagem trace summary traces/

The job runs on `stratagem.fit`; with ``--backup-dir`` it backs up after every epoch (chief only)
and a rerun resumes from the last backup, which is removed once training finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from stratagem import environ
from stratagem.cli.checks import check_device_flags, check_trace_flag, check_writable_directory
from stratagem.cli.launch import stop_message, stop_on_signals, stopped_by_signal
from stratagem.cluster import OutputLine, allocator, launched_by_stratagem, relaunch
from stratagem.demo import TARGET_ACCURACY, TrainConfig, TrainReport, train_digits
from stratagem.demo.digits import digits_layout_map
from stratagem.diagnose import PlacementDecision, log_placement
from stratagem.errors import InputError, Preempted, StratagemError
from stratagem.strategies.base import Strategy
from stratagem.strategies.by_name import TENSOR_PARALLEL, build_strategy, explain_built
from stratagem.strategies.data_parallel.amp import PRECISIONS
from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy
from stratagem.strategies.records import STRATEGIES
from stratagem.train import BackupAndRestore, Callback, ProgressBar

_DEFAULTS = TrainConfig()

TASK_GRACE_PERIOD_S = 30.0
"""What the tasks of a job this command started get between SIGTERM and SIGKILL: more than the 25 s within
which BackupAndRestore stops at a step boundary and backs up, so a stop is never cut short by the launcher."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a small conv net on the digits data set and show where it ran",
        description="Train a conv net on scikit-learn's 8x8 digits (no download) with a distribution strategy: "
        "every GPU, or two logical CPU replicas on a CPU-only machine. Prints the placement and why, "
        f"loss and accuracy per epoch, test accuracy (target {TARGET_ACCURACY:.0%}) and samples/s.",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES.names,
        default=_DEFAULTS.strategy,
        help=f"distribution strategy (default: {_DEFAULTS.strategy})",
    )
    parser.add_argument(
        "--devices",
        metavar="NAMES",
        type=_device_list,
        help="comma-separated devices in TF or torch spelling, e.g. cpu:0,cpu:1 or /gpu:0,/gpu:1 "
        "(default: every GPU, else two logical CPUs; one_device: the first GPU, else cpu:0)",
    )
    parser.add_argument(
        "--epochs",
        type=_count("10"),
        default=_DEFAULTS.epochs,
        help=f"passes over the training set (default: {_DEFAULTS.epochs})",
    )
    parser.add_argument(
        "--batch-size",
        type=_count("10"),
        default=_DEFAULTS.batch_size,
        help=f"GLOBAL batch size, split among the replicas (default: {_DEFAULTS.batch_size})",
    )
    parser.add_argument(
        "--lr", type=_positive_float, default=_DEFAULTS.lr, help=f"Adam learning rate (default: {_DEFAULTS.lr})"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=_DEFAULTS.seed,
        help=f"seeds the initial weights and the shuffle order (default: {_DEFAULTS.seed})",
    )
    parser.add_argument(
        "--workers",
        type=_count("2"),
        default=1,
        help=f"with --strategy {_one_process_per_worker()}: worker processes to start on this machine, as "
        "`stratagem launch` starts them (default: 1, or the cluster this process already belongs to)",
    )
    parser.add_argument(
        "--ps",
        type=_count("1"),
        default=None,
        help="with --strategy parameter_server: parameter-server processes to start (default: 1)",
    )
    parser.add_argument(
        "--backup-dir",
        metavar="DIR",
        help="back the run up in DIR after every epoch; a rerun of the same command (or a restart by "
        "`stratagem launch --max-restarts`) resumes from it; removed when training finishes",
    )
    parser.add_argument(
        "--log-placement",
        action="store_true",
        help="record where every operation of the run ran and print a summary: operations per "
        "device and replica, copies per step with their bytes, operations that ran off their "
        "replica's device (slows training down while it records)",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds at their defaults; by default the training processes keep "
        "freed memory for reuse, which spares each step thousands of page faults on a CPU",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=_DEFAULTS.precision,
        help="32: float32; bf16: bfloat16 autocast (CPUs and GPUs); fp16: float16 autocast with loss "
        f"scaling, GPUs only (default: {_DEFAULTS.precision})",
    )
    traced = parser.add_mutually_exclusive_group()
    traced.add_argument(
        "--trace",
        metavar="DIR",
        help="trace every step of every worker into DIR (worker-<rank>.json each, merged into DIR/trace.json.gz "
        "for Perfetto; read it with `stratagem trace summary DIR`); the strategies traced are in docs/trace.md. "
        "Without it, every strategy but parameter_server, one_device and central_storage records where a sample "
        "of the steps went (summary mode, about 1%% of a step's time) and the chief prints its mean step",
    )
    traced.add_argument(
        "--no-trace", action="store_true", help="record nothing, not even the default summary of the steps"
    )
    parser.add_argument("--json", action="store_true", help="print only a JSON summary, no progress bars")
    return parser


def run(args: argparse.Namespace) -> int:
    env = environ.current()
    try:
        _check_before_work(args)
    except StratagemError as error:
        print(f"stratagem train: {error}", file=sys.stderr)
        return 2
    record = STRATEGIES[args.strategy]
    parameter_server = record.parameter_servers
    if (parameter_server or (record.one_process_per_worker and args.workers > 1)) and not launched_by_stratagem(env):
        # Start one process per task running this same command; each becomes a task of the strategy's cluster.
        sink = _json_sink if args.json else _prefixed_sink
        with stop_on_signals() as stop:
            result = relaunch(
                args.argv,
                workers=args.workers,
                env=env,
                sink=sink,
                ps=(args.ps or 1) if parameter_server else 0,
                keep_freed_memory=not args.default_allocator,
                grace_period=TASK_GRACE_PERIOD_S,
                stop=stop,
            )
        if stopped_by_signal(stop, result):
            print(f"stratagem train: {stop_message(stop, result, args.backup_dir)}", file=sys.stderr)
        elif not result.ok:
            print(f"stratagem train: {result.explain()}", file=sys.stderr)
        elif args.trace:
            _say_trace_written(args.trace)
        return result.exit_code
    if not args.default_allocator:
        allocator.keep_freed_memory_here(env)  # this command owns its process (a task of a relaunch has it already)
    try:
        config = TrainConfig(
            strategy=args.strategy,
            devices=args.devices,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            precision=args.precision,
            trace=args.trace or not args.no_trace,
        )
        callbacks: list[Callback] = []
        if args.backup_dir:
            backup = BackupAndRestore(args.backup_dir, save_freq="epoch")
            callbacks += [backup, BackupSettings(config, backup, json_output=args.json)]
        # tensor_parallel splits the digits net's dense layers (demo.DIGITS_LAYOUTS); by name alone it would split none.
        layouts = digits_layout_map() if config.strategy == TENSOR_PARALLEL else None
        strategy, decision = build_strategy(config.strategy, config.devices, layout_map=layouts)
        try:
            _check_precision_flag(config.precision, [d.type for d in strategy.local_devices])  # before any work
        except StratagemError:
            strategy.close()
            raise
    except StratagemError as error:
        # Bad input to the command (a device this machine lacks, a bad value): say so, exit like argparse.
        print(f"stratagem train: {error}", file=sys.stderr)
        return 2
    # soft_wrap: long reasons stay on one line when piped to a file, instead of breaking at 80 columns.
    console = Console(highlight=False, soft_wrap=True)
    cluster = strategy.cluster  # only the strategies of several processes have one
    chief = cluster is None or cluster.is_chief
    if not chief:
        args.json = True  # workers other than the chief train silently; the chief reports for the job
    if not args.json:
        console.print(
            Text(
                f"stratagem train: digits, conv net, Adam lr={config.lr}, global batch {config.batch_size}, "
                f"{config.epochs} epoch(s), seed {config.seed}",
                style="bold",
            )
        )
        console.print(Text(f"devices: {decision.choice} ({decision.reason})"))
        # Once fit has distributed the model: the placement of its layers (BatchNorm or none) is known then.
        callbacks.insert(0, ShowPlacement(console, strategy, decision))
    # The progress bar is drawn only on a terminal; the per-epoch lines go to pipes too (not with --json).
    callbacks.append(ProgressBar(console, show_bar=not args.json and console.is_terminal, print_lines=not args.json))
    log = log_placement() if args.log_placement else None
    try:
        with log if log is not None else contextlib.nullcontext():
            report = train_digits(config, strategy, decision, callbacks=callbacks)
    except Preempted as stopped:
        # Not a failure: fit has backed up and said so (its warning names the step and the file), once.
        return stopped.code if isinstance(stopped.code, int) else 1
    except (StratagemError, ImportError, OSError) as error:
        print(f"stratagem train: training failed: {error}", file=sys.stderr)
        return 1
    finally:
        strategy.close()
    if args.trace and not launched_by_stratagem(env):  # else the command that launched this task says it
        _say_trace_written(args.trace)
    if not chief:
        return 0
    if args.json:
        summary = report.to_dict()
        if isinstance(strategy, MultiWorkerMirroredStrategy):
            # Each worker named slower than its peers (also logged as a warning by the chief as it happens).
            summary["stragglers"] = [straggler.to_dict() for straggler in strategy.stragglers]
        if log is not None:
            summary["placement"] = log.summary().to_dict()
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(console, report)
        if report.trace is not None:
            console.print(Text(report.trace.text()))
        if log is not None:
            console.print(Text(str(log.summary())))
    return 0


def _one_process_per_worker() -> str:
    """The strategies --workers starts, in words: "multi_worker, ..., sharded or tensor_parallel"."""
    several = [r.name for r in STRATEGIES if r.one_process_per_worker]
    return f"{', '.join(several[:-1])} or {several[-1]}"


def _check_before_work(args: argparse.Namespace) -> None:
    """What the command can refuse before it builds anything or starts a process."""
    record = STRATEGIES[args.strategy]
    if args.workers > 1 and not record.one_process_per_worker:
        first = next(r.name for r in STRATEGIES if r.one_process_per_worker)
        raise InputError(
            f"--workers {args.workers} needs --strategy {_one_process_per_worker()}. "
            f"Received: --strategy {args.strategy}. Add --strategy {first}, or leave --workers out."
        )
    with_ps = [r.name for r in STRATEGIES if r.parameter_servers]
    if args.ps is not None and not record.parameter_servers:
        raise InputError(
            f"--ps {args.ps} needs --strategy {' or '.join(with_ps)}. Received: --strategy {args.strategy}. "
            f"Add --strategy {with_ps[0]}, or leave --ps out."
        )
    if args.devices:
        if record.max_devices == 1 and len(args.devices) != 1:
            raise InputError(
                f"--strategy {args.strategy} runs on exactly one device. Received: --devices {','.join(args.devices)}. "
                "Name one device (e.g. --devices cpu:0), or use --strategy mirrored for several."
            )
        check_device_flags(args.devices)
    if args.backup_dir:
        if record.parameter_servers:
            # The optimizer's state lives on the parameter servers, out of reach of fit's backups.
            raise InputError(
                f"--backup-dir does not work with --strategy {args.strategy}: the optimizer state lives on the "
                f"parameter servers, which fit's backups cannot save. Received: --strategy {args.strategy} "
                f"--backup-dir {args.backup_dir}. Leave --backup-dir out, or use --strategy multi_worker for a "
                "resumable multi-process run."
            )
        check_writable_directory(args.backup_dir, "--backup-dir")
    if args.trace:
        check_trace_flag(args.strategy, args.trace)
        check_writable_directory(args.trace, "--trace")


def _say_trace_written(directory: str) -> None:
    """Where the merged trace is, on standard error (with --json, standard output carries the JSON alone)."""
    print(
        f"stratagem train: trace written to {Path(directory) / 'trace.json.gz'}; open it at "
        f"https://ui.perfetto.dev, or read it with `stratagem trace summary {directory}`",
        file=sys.stderr,
    )


def _check_precision_flag(precision: str, device_types: list[str]) -> None:
    """`check_precision`'s refusal of fp16 off the GPU, in the flags the user typed."""
    if precision == "fp16" and any(kind != "cuda" for kind in device_types):
        raise InputError(
            "--precision fp16 needs loss scaling (torch.amp.GradScaler), which stratagem supports on CUDA GPUs only, "
            "and float16 autocast on the CPU is slow and unsafe without it. Received: --precision fp16 with replicas "
            f"on {', '.join(sorted(set(device_types)))}. Use --precision bf16 on the CPU (no loss scaling needed), "
            "or run on GPUs."
        )


class ShowPlacement(Callback):
    """Prints where the strategy runs and why, once fit has distributed the model (so the explanation is of this
    model: a BatchNorm line only for a model with BatchNorm layers)."""

    def __init__(self, console: Console, strategy: Strategy, decision: PlacementDecision) -> None:
        self.console = console
        self.strategy = strategy
        self.decision = decision

    def on_train_begin(self, context: Any) -> None:
        if context.is_chief:
            self.console.print(Text(str(explain_built(self.strategy, self.decision))))


class BackupSettings(Callback):
    """Keeps the run's settings in its backup; a resumed run refuses other settings and says what it resumed.

    The backup restores the optimizer (its learning rate included), the random states and the data
    order, so a rerun with another --lr, --seed or --batch-size would silently train as the first run did
    (or be refused by the data's own check, in the library's words).
    """

    CHECKED = {"lr": "--lr", "seed": "--seed", "batch_size": "--batch-size"}
    """The settings compared, with their flags."""

    def __init__(self, config: TrainConfig, backup: BackupAndRestore, *, json_output: bool) -> None:
        self.config = config
        self.backup = backup
        self.json_output = json_output

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.config, name) for name in self.CHECKED}

    def _flags(self, names: list[str], values: dict[str, Any]) -> str:
        return " ".join(f"{self.CHECKED[name]} {values[name]}" for name in names)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: `check_state_dict` has compared the settings before anything was restored."""

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses a backup made with other settings, before fit's own checks of it (the data seed is --seed)."""
        # A setting missing from the backup (one written before it was kept) is left to fit's own checks.
        changed = [name for name in self.CHECKED if name in state and state[name] != getattr(self.config, name)]
        if changed:
            saved = self._flags(changed, state)
            asked = self._flags(changed, self.state_dict())
            raise InputError(
                f"The backup in {self.backup.backup_dir} was made with {saved}, which a resumed run keeps (the "
                f"optimizer, the random states and the data order come from the backup). Received: {asked}. Rerun with "
                f"{saved} to resume, or remove {self.backup.backup_dir} to start afresh with the new settings."
            )

    def on_train_begin(self, context: Any) -> None:
        restored = self.backup.restored_from
        if restored is None or not context.is_chief:
            return
        settings = ", ".join(f"{flag} {getattr(self.config, name)}" for name, flag in self.CHECKED.items())
        # Shown without -v: a resumed run must not look like a fresh one. With --json, stdout is the JSON alone.
        # The file really read: backup.previous.pt when the newest backup was damaged.
        print(
            f"stratagem train: Resumed from {self.backup.restored_path or self.backup.path}: epoch {restored['epoch'] + 1} of "
            f"{self.config.epochs}, after step {restored['step']}. From the backup: the model, the optimizer "
            f"state, the random states, the data order and the history of the epochs done ({settings}).",
            file=sys.stderr if self.json_output else sys.stdout,
            flush=True,
        )


CHIEF_TASK = "worker:0"
"""The task that reports for a relaunched job (worker 0 is the chief of a `stratagem launch` cluster)."""


def _prefixed_sink(line: OutputLine) -> None:
    stream = sys.stdout if line.stream == "stdout" else sys.stderr
    print(f"[{line.task}] {line.text}", file=stream, flush=True)


def _json_sink(line: OutputLine) -> None:
    """With --json, standard output carries the chief's JSON document alone, as it printed it; every
    other line (other tasks, anyone's standard error) goes to standard error, prefixed with its task."""
    if line.task == CHIEF_TASK and line.stream == "stdout":
        print(line.text, flush=True)
    else:
        print(f"[{line.task}] {line.text}", file=sys.stderr, flush=True)


def _print_summary(console: Console, report: TrainReport) -> None:
    test = report.test
    correct = round(test["accuracy"] * test.num_examples)
    verdict = (
        Text(f"reached the {TARGET_ACCURACY:.0%} target", style="green")
        if report.reached_target
        else Text(f"below the {TARGET_ACCURACY:.0%} target", style="bold red")
    )
    console.print(
        Text.assemble(
            f"test accuracy {test['accuracy']:.2%} ({correct}/{test.num_examples}), loss {test['loss']:.4f}: ", verdict
        )
    )
    resumed = (
        f", this run's alone: the {report.num_resumed_examples} trained before the resume are left out"
        if report.num_resumed_examples
        else ""
    )
    console.print(
        Text(
            f"throughput: {report.samples_per_s:,.0f} samples/s ({report.num_train_examples} training "
            f"examples in {report.train_time_s:.1f} s{resumed}); whole run {report.elapsed_s:.1f} s"
        )
    )
    if report.explanation["strategy"] == "ParameterServerStrategy":
        num_ps = len(report.explanation["details"]["ps"])
        console.print(
            Text(
                f"ran on: {', '.join(report.devices)} (ParameterServerStrategy, asynchronous updates "
                f"applied by {num_ps} parameter server(s))"
            )
        )
        for decision in report.explanation["decisions"]:
            if decision["subject"] == "values between workers and parameter servers":  # as this task saw them
                console.print(Text(f"values: {decision['choice']} ({decision['reason']})"))
        return
    physical = sorted({r["physical"] for r in report.explanation["replicas"]})
    in_sync = report.explanation["num_replicas_in_sync"]
    stages = report.explanation["strategy"] == "ModelParallelStrategy"
    local = f", {len(report.devices)} on this worker" if in_sync != len(report.devices) and not stages else ""
    where = f"stages on {', '.join(report.devices)}" if stages else ", ".join(report.devices)
    console.print(
        Text(
            f"ran on: {where} ({report.explanation['strategy']}, "
            f"{in_sync} replica(s) in sync{local}, physical {', '.join(physical)})"
        )
    )


def _device_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"a device name is empty. Received: {text!r}. Separate names with single commas, e.g. cpu:0,cpu:1"
        )
    return names


def _count(example: str) -> Any:
    """A positive integer option whose error gives an example that suits it (--workers 2, --ps 1, --epochs 10)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {text!r}. Use e.g. {example}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number. Received: {text!r}. Use e.g. 0.003")
    return value
