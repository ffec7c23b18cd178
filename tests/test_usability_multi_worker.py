"""gather and the chief-only callbacks under MultiWorkerMirroredStrategy: one launched job of 2 workers
with 2 local replicas each (tests/workers/usability_mw.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stratagem import environ
from stratagem.cluster import launch

WORKER = str(Path(__file__).parent / "workers" / "usability_mw.py")
pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(180)
def test_gather_and_callbacks_across_two_workers(tmp_path):
    env = dict(environ.current())
    env["UW_OUT"] = str(tmp_path)
    lines: list[str] = []
    result = launch([sys.executable, WORKER], workers=2, env=env,
                    sink=lambda line: lines.append(f"[{line.task}] {line.text}"), timeout=150, grace_period=2)
    assert result.exit_code == 0, "\n".join(lines[-40:])
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        gathered = seen[rank]["gather"]
        assert gathered["x2"] == [2.0 * i for i in range(7)]        # every worker gets the whole, in order
        assert gathered["n"] == [2, 2, 2, 1]
        assert gathered["names"] == [f"ex{i}" for i in range(7)]
        assert gathered["ranks"] == [0.0, 1.0]
