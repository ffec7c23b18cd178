"""``stratagem doctor``: why is my GPU not used, and does training work here?

Prints every check (ok / warning / problem, with reason and fix), what ``MirroredStrategy()``
would use on this machine and why, then a smoke test: one all-reduce across those devices and one
training step on each, through the real strategy.

Exit code: 0 when nothing blocks training, 1 when a check is a ``problem`` or a smoke-test step
fails (the rule is `stratagem.diagnose.exit_code`; warnings such as a CPU-only build never block).

    $ stratagem doctor
    $ stratagem doctor --json
    $ stratagem doctor --facts other-machine.json     # replay the checks on recorded facts
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from stratagem import environ
from stratagem.devices import DeviceRegistry, default_devices, resolve_devices
from stratagem.diagnose import (
    DoctorReport,
    EnvironmentFacts,
    PlacementDecision,
    SmokeResult,
    blocking_checks,
    check_environment,
    collect_facts,
)
from stratagem.errors import StratagemError

# A smoke-test replica that waits longer than this for the others is reported as a failure.
SMOKE_TIMEOUT_S = 60.0

_VERDICT_STYLE = {"ok": "green", "warning": "yellow", "problem": "bold red"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="diagnose why a GPU is or is not used, and smoke-test training",
        description="Check the torch build, driver, CUDA_VISIBLE_DEVICES, NCCL and cuDNN; say what "
        "MirroredStrategy() would use; run one all-reduce and one training step per device. "
        "Exits 1 when something blocks training.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--facts",
        metavar="PATH",
        help="check facts recorded on another machine (the 'facts' of its --json report) "
        "instead of this machine's; skips the smoke test",
    )
    parser.add_argument(
        "--devices",
        metavar="NAMES",
        help="comma-separated devices to smoke-test instead of MirroredStrategy()'s default, "
        "e.g. cpu:0,cpu:1 or /gpu:0,/gpu:1",
    )
    parser.add_argument("--no-smoke-test", action="store_true", help="skip the all-reduce and training step")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        facts = _load_facts(args.facts) if args.facts else _collect_facts_safely()
        devices = [name.strip() for name in args.devices.split(",")] if args.devices else None
        report = build_report(
            facts,
            devices=devices,
            smoke_test=not (args.no_smoke_test or args.facts),
            skipped_because="facts were loaded from a file" if args.facts else "--no-smoke-test",
        )
    except (StratagemError, OSError, ValueError) as error:
        # Bad input to the command itself (a device list, a facts file): say so, exit like argparse.
        print(f"stratagem doctor: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    return report.exit_code


def _collect_facts_safely() -> EnvironmentFacts:
    """This machine's facts; a probe that fails in a way nobody foresaw becomes a fact, never a traceback."""
    try:
        return collect_facts(environ.current())
    except Exception as error:  # noqa: BLE001 - the doctor exists for broken machines
        return EnvironmentFacts(
            torch_version=torch.__version__,
            torch_cuda_version=torch.version.cuda,
            cuda_init_error=f"collecting the facts failed: {type(error).__name__}: {error}",
        )


def _load_facts(path: str) -> EnvironmentFacts:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as error:
        raise ValueError(
            f"--facts: cannot read {path} ({error.strerror or error}). Received: --facts {path}. Give a "
            "file saved with `stratagem doctor --json > facts.json` on the other machine."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"--facts: {path} is not JSON ({error}). Received: --facts {path}. Give a file saved with "
            "`stratagem doctor --json > facts.json` on the other machine."
        ) from None
    try:
        # Either a whole `doctor --json` report or the bare facts.
        return EnvironmentFacts.from_dict(data.get("facts", data))
    except (TypeError, AttributeError) as error:
        raise ValueError(
            f"{path} does not hold stratagem facts ({error}). Received: a file with keys "
            f"{sorted(data) if isinstance(data, dict) else type(data).__name__}. Use the output of "
            "`stratagem doctor --json` from the other machine."
        ) from error


def build_report(
    facts: EnvironmentFacts,
    *,
    devices: Sequence[str] | None = None,
    smoke_test: bool = True,
    skipped_because: str = "--no-smoke-test",
) -> DoctorReport:
    """The checks, the placement over the devices ``facts`` describe, and the smoke test.

    ``devices`` replaces ``MirroredStrategy()``'s default choice for the smoke test.

    Raises:
        DeviceError: ``devices`` names a device this machine does not have.
    """
    registry = DeviceRegistry.from_facts(facts)
    default, decision = default_devices(registry, facts)
    names = [device.name for device in default]
    if devices is not None:
        names = [device.name for device in resolve_devices(devices, registry, facts=facts)]
        decision = PlacementDecision(subject="devices", choice=", ".join(names), reason="given by --devices")
    if smoke_test:
        smoke = run_smoke_test(names, registry)
    else:
        smoke = [SmokeResult(name="smoke test", passed=None, detail=f"skipped: {skipped_because}")]
    return DoctorReport(facts=facts, checks=check_environment(facts), devices=names, decision=decision, smoke=smoke)


def run_smoke_test(device_names: Sequence[str], registry: DeviceRegistry) -> list[SmokeResult]:
    """One all-reduce across ``device_names`` and one training step on each, via MirroredStrategy."""
    # Imported here: the strategies sit above devices and diagnose, and doctor must still report
    # the environment when a strategy cannot even be built.
    try:
        import stratagem as sg

        strategy = sg.MirroredStrategy(devices=list(device_names), registry=registry, timeout=SMOKE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - the doctor reports any failure instead of crashing
        return [SmokeResult(name="build MirroredStrategy", passed=False, detail=f"{type(error).__name__}: {error}")]
    try:
        return [_all_reduce(strategy, device_names)] + _training_steps(strategy, device_names)
    finally:
        strategy.close()


def _all_reduce(strategy, device_names: Sequence[str]) -> SmokeResult:
    import stratagem as sg

    name = f"all-reduce across {', '.join(device_names)}"
    try:

        def replica_value() -> torch.Tensor:
            context = sg.current_replica_context()
            assert context is not None  # strategy.run calls it inside a replica
            return torch.full((3,), float(context.replica_id_in_sync_group + 1), device=context.device)

        total = strategy.reduce("sum", strategy.run(replica_value))
        # Replica r contributes r + 1, so the sum over n replicas is n (n + 1) / 2 in every element.
        n = len(device_names)
        expected = torch.full((3,), n * (n + 1) / 2)
        if not torch.equal(total.cpu(), expected):
            return SmokeResult(name=name, passed=False, detail=f"got {total.tolist()}, expected {expected.tolist()}")
        return SmokeResult(name=name, passed=True, detail=f"sum over {n} replica(s) = {expected.tolist()}")
    except Exception as error:  # noqa: BLE001 - reported, not raised
        return SmokeResult(name=name, passed=False, detail=f"{type(error).__name__}: {error}")


def _training_steps(strategy, device_names: Sequence[str]) -> list[SmokeResult]:
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    x = torch.randn(2 * len(device_names), 4, generator=generator)
    y = torch.randn(2 * len(device_names), 2, generator=generator)
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(reference.state_dict())
    # The expected parameters: one SGD step of the same model on the whole global batch.
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.mse_loss(reference(x), y).backward()
    reference_opt.step()
    try:
        distributed, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))

        def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(distributed(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        for xb, yb in strategy.distribute_dataset([(x, y)]):
            strategy.run(step, args=(xb, yb))
    except Exception as error:  # noqa: BLE001 - reported, not raised
        return [SmokeResult(name="training step", passed=False, detail=f"{type(error).__name__}: {error}")]
    replicas = getattr(distributed, "replicas", [distributed])
    results = []
    for name, replica in zip(device_names, replicas):
        worst = max(
            float((p.detach().cpu() - q.detach()).abs().max())
            for p, q in zip(replica.parameters(), reference.parameters())
        )
        passed = worst <= 1e-5
        detail = (
            f"parameters match one SGD step on the global batch (max difference {worst:.1e})"
            if passed
            else f"parameters differ from one SGD step on the global batch by {worst:.1e} (> 1e-5)"
        )
        results.append(SmokeResult(name=f"training step on {name}", passed=passed, detail=detail))
    return results


def _print_report(report: DoctorReport) -> None:
    console = Console()
    table = Table(title="stratagem doctor")
    for column in ("check", "verdict", "reason", "fix"):
        table.add_column(column, overflow="fold")
    for check in report.checks:
        # Text, not markup: reasons quote values like devices=['cuda:0'] that rich would parse.
        table.add_row(
            check.name, Text(check.verdict, style=_VERDICT_STYLE[check.verdict]), Text(check.reason), Text(check.fix)
        )
    console.print(table)
    console.print(f"MirroredStrategy() would use: {', '.join(report.devices)}", markup=False, highlight=False)
    console.print(f"  because {report.decision.reason}", markup=False, highlight=False)
    table = Table(title="smoke test")
    for column in ("step", "result", "detail"):
        table.add_column(column, overflow="fold")
    for step in report.smoke:
        result = {True: Text("passed", style="green"), False: Text("failed", style="bold red"), None: Text("skipped")}[
            step.passed
        ]
        table.add_row(Text(step.name), result, Text(step.detail))
    console.print(table)
    blocking = blocking_checks(report.checks)
    failed = [step.name for step in report.smoke if step.passed is False]
    if report.exit_code == 0:
        console.print("[green]Nothing blocks training.[/] (exit code 0)")
    else:
        what = [check.name for check in blocking] + failed
        console.print(Text(f"Blocked by: {', '.join(what)} (exit code 1)", style="bold red"))
