"""The techniques machinery every strategy of one process per worker shares: checks first, then the table's order,
each technique only where the mesh has one of its axes, and explain()'s line."""

from __future__ import annotations

import pytest

from stratagem.errors import InputError
from stratagem.strategies.worker_group.techniques import (
    ONE_DATA_AXIS,
    Technique,
    apply_techniques,
    check_techniques,
    techniques_decision,
)


def _table(calls: list[str]) -> tuple[Technique[list[str]], ...]:
    def refuse_empty(placing: list[str]) -> None:
        calls.append("check sharding")
        if placing == ["empty"]:
            raise InputError("Nothing to shard. Received: an empty model. Give it a parameter.")

    return (
        Technique(name="split", axes=("model",), apply=lambda p: calls.append("split")),
        Technique(name="sharding", axes=("data",), apply=lambda p: calls.append("sharding"), check=refuse_empty),
        Technique(name="replication", axes=("data",), apply=lambda p: calls.append("replication")),
    )


def test_the_checks_run_alone_and_a_refusal_comes_from_the_technique_that_cannot_honour_it() -> None:
    calls: list[str] = []
    with pytest.raises(InputError, match="Nothing to shard"):
        check_techniques(_table(calls), ["empty"], ("data", "model"))
    assert calls == ["check sharding"]  # no technique applied by a check


def test_the_techniques_apply_in_the_tables_order_each_only_on_a_mesh_with_its_axes() -> None:
    calls: list[str] = []
    apply_techniques(_table(calls), [], ("data", "model"))
    assert calls == ["split", "sharding", "replication"]
    calls.clear()
    apply_techniques(_table(calls), [], ONE_DATA_AXIS)
    assert calls == ["sharding", "replication"]
    calls.clear()
    check_techniques(_table(calls), [], ("model",))
    assert calls == []  # sharding's check skipped with it


def test_explain_names_the_techniques_applied_in_order_with_their_axes_and_notes() -> None:
    decision = techniques_decision(_table([]), ONE_DATA_AXIS, reason="why", notes={"sharding": " (stage 3)"})
    assert (decision.subject, decision.choice, decision.reason) == (
        "techniques",
        "sharding on data (stage 3), then replication on data",
        "why",
    )
