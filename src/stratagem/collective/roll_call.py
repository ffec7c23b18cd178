"""After a collective fails or times out: the roll call of the workers still alive, and the exchange of their flight
records through the job's store (`flight.py`), for the error `CrossWorker` raises. Every call on the store is
bounded (`StoreCalls`): the chief that hosts it may be the worker that is gone."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from stratagem.collective.flight import FlightRecord, first_difference
from stratagem.collective.store_calls import StoreCalls
from stratagem.errors import CollectiveTimeoutError

ROLL_CALL = "stratagem/rollcall/{step}/{rank}"
FLIGHT = "stratagem/flight/{step}/{rank}"
FLIGHT_NEWEST = "stratagem/flight-newest/{rank}"
"""Each worker's newest collective, which its pulse thread keeps current (`CrossWorker.start_pulse`)."""


def roll_call(
    store_calls: StoreCalls, store: Any, step: int, rank: int, world_size: int, seconds: float
) -> tuple[list[int], bool]:
    """Which ranks are still alive: each survivor signs in, then reads who else did (within `seconds`, a store
    that does not answer meaning the chief is gone). Returns (the ranks missing, whether the store answered)."""
    deadline = time.monotonic() + seconds

    def call(what: str, fn: Any, *args: Any) -> Any:
        return store_calls.run(what, fn, *args, seconds=max(0.05, deadline - time.monotonic()) + 1.0)

    try:
        call("the roll call", store.set, ROLL_CALL.format(step=step, rank=rank), "here")
        keys = [ROLL_CALL.format(step=step, rank=r) for r in range(world_size)]

        def absent() -> list[int]:
            return [r for r, key in enumerate(keys) if not store.check([key])]

        missing = call("the roll call", absent)
        while missing and time.monotonic() < deadline:
            try:
                call(
                    "the roll call",
                    store.wait,
                    [keys[r] for r in missing],
                    timedelta(seconds=max(0.05, deadline - time.monotonic())),
                )
            except CollectiveTimeoutError:
                raise
            except Exception:  # noqa: BLE001 - a store wait that runs out just means someone is missing
                pass
            missing = call("the roll call", absent)
        return missing, True
    except Exception:  # noqa: BLE001 - the store is gone (or stopped) with the chief
        return [0] if rank != 0 else [], False


def publish_flight(
    flight: FlightRecord, store_calls: StoreCalls, store: Any, step: int, rank: int, seconds: float
) -> str | None:
    """Dumps this worker's flight record to a file and puts it in the store under the failed step; the file's
    path, or None when it could not be written."""
    path = flight.dump()
    try:
        key = FLIGHT.format(step=step, rank=rank)
        store_calls.run("the flight record", store.set, key, json.dumps(flight.entries()), seconds=seconds)
    except Exception:  # noqa: BLE001 - the chief's store may be gone: the error says so from the roll call
        pass
    return None if path is None else str(path)


def compare_flights(
    store_calls: StoreCalls, store: Any, step: int, task_names: Sequence[str], missing: Sequence[int], seconds: float
) -> str:
    """Where the flight records in the store (each worker's, put there by its own failure) first differ; for a
    worker that did not fail (stuck, slow or gone), the newest collective its pulse reported."""
    records: dict[str, list[dict[str, Any]] | None] = {}
    newest_only = []

    def read(key: str) -> Any:
        if not store_calls.run("the flight record", store.check, [key], seconds=seconds):
            return None
        return json.loads(store_calls.run("the flight record", store.get, key, seconds=seconds))

    for rank, name in enumerate(task_names):
        records[name] = None
        try:
            if rank not in missing:
                records[name] = read(FLIGHT.format(step=step, rank=rank))
            if records[name] is None:
                newest = read(FLIGHT_NEWEST.format(rank=rank))
                if newest is not None:
                    records[name] = [newest]
                    newest_only.append(name)
        except Exception:  # noqa: BLE001 - a record that cannot be read is reported as missing
            pass
    return first_difference(records, newest_only)
