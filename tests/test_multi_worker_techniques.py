"""MultiWorkerMirroredStrategy is its record plus its table of techniques: replication along the one `data` axis."""

from __future__ import annotations

from typing import Any

from torch import nn

from stratagem.strategies.multi_worker.techniques import TECHNIQUES, Replicating, TechniquesPart
from stratagem.strategies.records import STRATEGIES
from stratagem.strategies.worker_group.techniques import ONE_DATA_AXIS, apply_techniques


def test_the_strategys_record_lists_its_one_technique_replication_along_data() -> None:
    assert [(t.name, t.axes) for t in STRATEGIES["multi_worker"].techniques] == [("replication", ("data",))]
    assert STRATEGIES["multi_worker"].techniques == TECHNIQUES


class _ReplicaSet:
    def __init__(self) -> None:
        self.handed: list[tuple[Any, Any]] = []

    def distribute(self, model: nn.Module, optimizer: Any) -> tuple[str, str]:
        self.handed.append((model, optimizer))
        return "distributed model", "distributed optimizer"


def test_replication_hands_the_model_and_optimizer_to_the_replica_set_and_keeps_what_it_returns() -> None:
    replicas, model = _ReplicaSet(), nn.Linear(2, 2)
    placing = Replicating(model=model, optimizer=None, replicas=replicas)  # type: ignore[arg-type]
    apply_techniques(TECHNIQUES, placing, ONE_DATA_AXIS)
    assert replicas.handed == [(model, None)]
    assert placing.distributed == ("distributed model", "distributed optimizer")


def test_explain_names_the_technique_as_the_first_part() -> None:
    [line] = TechniquesPart().decisions()
    assert (line.subject, line.choice) == ("techniques", "replication on data")
    assert TechniquesPart().details() == {}
