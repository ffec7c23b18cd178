"""Seconds from a SIGSTOP of worker:1 to the coordinator naming it hung, with the default heartbeat (2 s / 10 s).

Runs a chief, one parameter server and two workers on 127.0.0.1 (tests/workers/ps_hung.py on each, started by
tests/test_ps_hung.py's ``Job``), stops worker:1 in its 3rd step and prints, per run, the chief's exit code, the
results it fetched and the time to detection. Usage, from the repository root:

    PYTHONPATH=src python tests/workers/measure_hung.py 3
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_ps_hung import Job  # noqa: E402 - the tests folder is put on the path just above

STEPS = 120

for run in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    job = Job(
        Path(tempfile.mkdtemp()),
        workers=2,
        PS_TEST_STEPS=str(STEPS),
        PS_TEST_STEP_SLEEP="0.3",
        PS_TEST_RECOVERY="5",
        PS_TEST_HEARTBEAT="default",
    )
    try:
        for _ in range(3):
            job.wait_for("[worker:1] step started on worker:1", 120)
        stopped = job.signal("worker:1", signal.SIGSTOP)
        code = job.processes["chief:0"].wait(180)
        result = json.loads(job.out.read_text())
        hung = [f for f in result["faults"] if f["task"] == "worker:1" and f["kind"] == "hung"]
        detected = f"{hung[0]['at'] - stopped:.2f} s" if hung else "never"
        print(
            f"run {run}: chief exit code {code}, {len(result.get('losses', []))} of {STEPS} results, "
            f"worker:1 named hung {detected} after SIGSTOP",
            flush=True,
        )
    finally:
        job.close()
