"""The guard of a launcher's tasks: ends them when the launcher dies, however it dies.

Tasks lead their own sessions (``processes``), so a launcher killed with SIGKILL, or by the
out-of-memory killer, would leave them running with nobody to stop them: an orphaned chief could
go on writing the backup directory of a restarted job. The launcher starts this script as a small
process of its own (in its own session, so a Ctrl-C or a scheduler's signal to the launcher's
group does not reach it) and writes to its standard input, one line each, ``+PGID`` for every
task it starts and ``-PGID`` for every task it has stopped. The write end of that pipe is held by
the launcher alone: when the launcher exits, normally or not, the guard reads the end of the
file, sends SIGTERM to every process group still listed, and SIGKILL to what is left after the
grace period. A pipe's end is seen on every POSIX system, so this works wherever the launcher
does (Linux and macOS).

It is run by path, with the standard library only (``python -I -S guard.py GRACE``), so it starts
in milliseconds and imports neither torch nor stratagem.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_SECONDS = 0.05


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str]) -> int:
    grace = float(argv[1]) if len(argv) > 1 else 5.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the end of the pipe ends the guard
    listed: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word[:1] in "+-" and word[1:].isdigit():
            (listed.add if word[0] == "+" else listed.discard)(int(word[1:]))
    # The launcher is gone (or has closed the pipe after stopping every task, leaving none listed).
    _signal(listed, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pgid) for pgid in listed):
        time.sleep(POLL_SECONDS)
    _signal(listed, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
