"""ShardedStrategy is its record plus its table of techniques: data sharding along the one `data` axis."""

from __future__ import annotations

from stratagem.strategies.records import STRATEGIES
from stratagem.strategies.sharded.techniques import TECHNIQUES, techniques_line


def test_the_strategys_record_lists_its_one_technique_data_sharding_along_data() -> None:
    assert [(t.name, t.axes) for t in STRATEGIES["sharded"].techniques] == [("data sharding", ("data",))]
    assert STRATEGIES["sharded"].techniques == TECHNIQUES


def test_explain_names_the_technique_and_why() -> None:
    line = techniques_line()
    assert (line.subject, line.choice) == ("techniques", "data sharding on data")
    assert "fully_shard per unit, then the root" in line.reason
