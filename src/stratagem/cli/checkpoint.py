"""``stratagem checkpoint``: what a backup directory holds, and whether every checksum in it holds.

Usage:
    $ stratagem checkpoint inspect /shared/run1/backup     # step, epoch, strategy, world size, sizes, files
    $ stratagem checkpoint verify /shared/run1/backup      # exit code 0: every file whole; 1: one is damaged
    $ stratagem checkpoint inspect backup/backup.pt --json
    $ stratagem checkpoint export /shared/run1/backup model.safetensors   # the plain model (or model.pt)
    $ stratagem checkpoint export model.pt model.dcp       # and back: a sharded checkpoint of a plain model

``verify`` reads every member of every backup file and compares its CRC32, and every file of a
sharded backup (``backup.dcp/``) with the sha256 its manifest lists (the same checks a resumed run
makes before it uses a backup); a backup moved aside as damaged (``backup.corrupt.pt``,
``backup.corrupt.dcp``) is listed but does not fail it. ``inspect`` lists a sharded backup's files by
the rank that wrote them. Epochs are counted from 1 in the text and in ``--json`` alike: the epoch
a resumed run goes on in, as its progress bar counts it. Exit codes: 0 whole, 1 damaged (or no
backup at all), 2 a bad argument. ``export`` writes the newest whole backup's model (a sharded one read
as whole tensors, in this process), with the keys of the model you built, to one file: safetensors when its
name ends in ``.safetensors``, else ``torch.save`` of the state_dict; when a newer backup is damaged, it says
so and which older one it exported.
"""

from __future__ import annotations

import argparse
import json
import sys

from stratagem.errors import InputError
from stratagem.train.backup.report import BACKUP_FILES, SHARDED_BACKUPS, BackupReport, export_model, inspect_backups

NEWEST_BACKUPS = (BACKUP_FILES[0], SHARDED_BACKUPS[0])
"""The names of the newest backup of a directory (whole, sharded): one passed over makes an export of an older step."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="inspect, verify or export the backups of BackupAndRestore",
        description="Inspect the backups in a BackupAndRestore directory (or one checkpoint file), verify every "
        "checksum in them (exit code 0 when every file is whole, 1 otherwise), or export the newest whole backup's "
        "model to one torch or safetensors file.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("inspect", "step, epoch (counted from 1), strategy, world size, sizes and files of each backup"),
        ("verify", "check every checksum of every backup file; exit code 0 or 1"),
    ):
        action = actions.add_parser(name, help=help_text, description=help_text)
        action.add_argument("path", help="a backup directory (BackupAndRestore's backup_dir) or a checkpoint file")
        action.add_argument("--json", action="store_true", help="print JSON instead of text")
    export = actions.add_parser(
        "export",
        help="write the plain model of the newest whole backup to one torch or safetensors file",
        description="Write the model of the newest whole backup (keys as in the model you built) to OUTPUT: "
        "safetensors when its name ends in .safetensors, else torch.save of the state_dict.",
    )
    export.add_argument("path", help="a backup directory (BackupAndRestore's backup_dir) or a checkpoint file")
    export.add_argument(
        "output",
        help="the file to write (model.pt or model.safetensors), or a sharded checkpoint directory (model.dcp)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _export(args)
    try:
        report = inspect_backups(args.path)
    except InputError as error:
        print(f"stratagem checkpoint {args.action}: error: {error}", file=sys.stderr)
        return 2 if args.action == "inspect" else 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print("\n".join(_lines(report, args.action)))
    if args.action == "verify":
        return 0 if report.ok else 1
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        export = export_model(args.path, args.output)
    except InputError as error:
        print(f"stratagem checkpoint export: error: {error}", file=sys.stderr)
        return 2
    used = export.used
    when = "" if used.step is None else f" (step {used.step}, epoch {used.epoch})"
    for skipped in export.skipped:
        older = ", an older backup than the newest written" if skipped.name in NEWEST_BACKUPS else ""
        print(
            f"stratagem checkpoint export: warning: {skipped.path} is damaged and was passed over; exporting "
            f"{used.path}{when}{older}. {skipped.error}",
            file=sys.stderr,
        )
    print(f"wrote the model of {used.path}{when} to {args.output}")
    return 0


def _lines(report: BackupReport, action: str) -> list[str]:
    lines = [f"{report.path}:"]
    for entry in report.files:
        if not entry.ok:
            lines.append(f"  {entry.name}  {_size(entry.bytes)}  DAMAGED: {entry.error}")
            continue
        if action == "verify":
            what = f"{len(entry.shards)} files, every sha256 holds" if entry.shards else "every checksum holds"
            lines.append(f"  {entry.name}  {_size(entry.bytes)}  ok ({what})")
            continue
        epoch = "?" if entry.epoch is None else entry.epoch
        world = (
            f"{entry.strategy or '?'}, {entry.num_replicas_in_sync} replica(s) in {entry.num_processes} process(es)"
            if entry.num_replicas_in_sync is not None
            else f"{entry.strategy or 'strategy not recorded'}"
        )
        lines.append(
            f"  {entry.name}  {_size(entry.bytes)}  step {entry.step}, epoch {epoch} "
            f"({entry.step_in_epoch} batch(es) into it), {world}"
        )
        lines.append("    " + ", ".join(f"{part} {_size(size)}" for part, size in entry.parts.items()))
        for shard in entry.shards:
            lines.append(f"    rank {shard['rank']}: {shard['name']}  {_size(shard['num_bytes'])}")
    for name in report.temporaries:
        lines.append(f"  {name}  a save in progress, or one a stopped job did not finish")
    if report.owner is not None:
        lines.append(f"  held by pid {report.owner['pid']} on host {report.owner['host']!r} (.stratagem-claim)")
    if action == "verify":
        lines.append("every backup is whole" if report.ok else "a backup is damaged (or there is none): exit code 1")
    return lines


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
