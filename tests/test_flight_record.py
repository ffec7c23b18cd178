"""A hang leaves a record (issue 42, item 7): each worker keeps its last 64 collectives; when one times out, every
worker that can still write dumps them, and the error names the first collective at which the workers' records
differ and who never arrived. The comparison on synthetic records; the whole path on 3 launched workers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import launch_json_workers

from stratagem.collective.flight import FIELDS, KEPT, FlightRecord, first_difference


def _record(*whats: str, done: int | None = None) -> list[dict]:
    flight = FlightRecord("worker:0")
    for i, what in enumerate(whats):
        seq = flight.enter("all_reduce", what, i // 2 + 1, 16, "gloo")
        if done is None or seq <= done:
            flight.done(seq)
    return flight.entries()


def test_the_ring_keeps_the_last_64_and_dumps_them_as_json(tmp_path):
    flight = FlightRecord("worker:1")
    for i in range(100):
        seq = flight.enter("all_gather", f"metric {i}", i, 8 * i, "shared memory")
        if i < 99:
            flight.done(seq)
    entries = flight.entries()
    assert len(entries) == KEPT == 64
    assert [e["seq"] for e in entries] == list(range(37, 101))
    assert entries[-1]["state"] == "entered" and entries[-2]["state"] == "done"
    assert flight.newest() == entries[-1]
    path = flight.dump(tmp_path / "flight")
    assert path is not None and path.name.startswith("flight-worker-1-")
    dumped = json.loads(path.read_text())
    assert dumped["task"] == "worker:1" and [tuple(e) for e in dumped["collectives"]] == [FIELDS] * 64
    assert dumped["collectives"] == entries


def test_an_unwritable_directory_loses_the_file_not_the_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert FlightRecord("worker:0").dump(blocker / "flight") is None


def test_the_first_collective_two_workers_entered_differently_is_named():
    a = _record("gradients", "loss", "gradients", "loss", "gradients")
    b = _record("gradients", "loss", "gradients", "gradients")  # worker:1 left out a loss reduce
    message = first_difference({"worker:0": a, "worker:1": b})
    assert message.startswith("the workers diverge at collective #4: worker:0 entered loss (all_reduce, step 2"), (
        message
    )
    assert "worker:1 entered gradients (all_reduce, step 2" in message


def test_a_worker_that_never_reached_a_collective_is_named_with_its_last():
    a = _record("gradients", "loss", "gradients", done=2)
    behind = _record("gradients", "loss")
    message = first_difference({"worker:0": a, "worker:1": a, "worker:2": behind[-1:]}, newest_only=["worker:2"])
    assert message.startswith("at collective #3 (gradients (all_reduce, step 2, 16 bytes, entered)) worker:0, "
                              "worker:1 arrived and worker:2 (its last: #2 loss"), message  # fmt: skip
    assert message.endswith("worker:2: the newest collective its pulse reported")
    silent = first_difference({"worker:0": a, "worker:1": None})
    assert "no record from worker:1 (gone, or stuck where it cannot answer)" in silent, silent
    assert first_difference({"worker:0": a, "worker:1": a}).startswith("the records that arrived agree up to #3")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_three_workers_one_stuck_both_others_name_the_collective_it_never_reached(tmp_path):
    settings = dict(
        FL_STALL_RANK=1, FL_STEP=3, FL_STALL_S=20, FL_TIMEOUT=3, FL_LINGER_S=4, STRATAGEM_FLIGHT_DIR=tmp_path
    )
    code, outcomes, lines = launch_json_workers("mwms_flight.py", settings, timeout=120, workers=3)
    assert code != 0, lines[-20:]
    for rank in (0, 2):
        message = outcomes[rank]["message"]
        found = re.search(
            r"Collectives: at collective #(\d+) \(gradient all-reduce \(all_reduce, step 3, \d+ bytes, entered\)\) "
            r"worker:0, worker:2 arrived and worker:1 \(its last: #(\d+) reduce \(all_reduce, step 2",
            message,
        )
        assert found and int(found[2]) == int(found[1]) - 1, message
        kept = int(found[1])  # the collectives so far: fewer than 64, all kept
        dumped = Path(message.split(f"kept its last {kept} in ", 1)[1].split(")", 1)[0])
        assert dumped.parent == tmp_path
        record = json.loads(dumped.read_text())
        assert record["task"] == f"worker:{rank}"
        assert [e["seq"] for e in record["collectives"]] == list(range(1, kept + 1))
        assert record["collectives"][-1]["state"] == "entered", record
