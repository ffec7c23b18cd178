"""Functions that tests/test_launch_function.py runs in the tasks of `sg.launch`."""

from __future__ import annotations

import os
import time


def fail_on_worker_one(seconds: float) -> int:
    """Worker 1 raises at once; worker 0 would sleep for `seconds` unless stopped."""
    if os.environ["RANK"] == "1":
        raise RuntimeError("worker one gives up")
    time.sleep(seconds)
    return 0


def sleep(seconds: float) -> None:
    time.sleep(seconds)
