"""The strategy records: one per strategy, names unique, and every list of choices taken from them."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import stratagem
import stratagem.strategies
from stratagem.bench.registry import BENCH_STRATEGIES
from stratagem.cli.main import build_parser
from stratagem.devices import DeviceRegistry
from stratagem.errors import InputError
from stratagem.strategies.by_name import STRATEGY_NAMES, build_strategy
from stratagem.strategies.records import STRATEGIES, StrategyRegistry
from stratagem.strategies.worker_group.techniques import Technique


def _choices(command: str, option: str) -> tuple[str, ...]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if option in a.option_strings)
    return tuple(action.choices)


def test_a_second_record_of_the_same_name_is_refused_with_the_name() -> None:
    mirrored = STRATEGIES["mirrored"]
    twin = dataclasses.replace(mirrored, strategy_path=STRATEGIES["central_storage"].strategy_path)
    with pytest.raises(
        InputError,
        match=r"Two strategy records have the same name\. Received: name='mirrored' for MirroredStrategy "
        r"and CentralStorageStrategy\. Give each record a name of its own\.",
    ):
        StrategyRegistry([mirrored, STRATEGIES["one_device"], twin])


def test_every_command_line_choice_list_is_the_registrys_names() -> None:
    names = STRATEGIES.names
    assert names == (
        "mirrored",
        "one_device",
        "multi_worker",
        "central_storage",
        "model_parallel",
        "parameter_server",
        "sharded",
        "tensor_parallel",
    )
    assert _choices("train", "--strategy") == names
    assert _choices("launch", "--strategy") == names
    assert STRATEGY_NAMES == names
    # bench measures the strategies whose record says how to build them there, in the records' order
    assert tuple(BENCH_STRATEGIES) == tuple(r.name for r in STRATEGIES if r.bench_build is not None)
    assert tuple(BENCH_STRATEGIES) == ("mirrored", "one_device", "multi_worker", "central_storage", "sharded")


# What explain() says of each strategy built of techniques, on one worker, built by name (tensor_parallel's mesh: one
# `model` axis). Each one's table, in order, is held in its own tests (test_<name>_techniques.py).
EXPLAINED = {
    "multi_worker": "techniques: replication on data",
    "sharded": "techniques: data sharding on data",
    "tensor_parallel": "techniques: tensor parallel on model",
}


def test_each_multi_process_strategy_but_the_parameter_server_is_its_record_plus_a_table_of_techniques() -> None:
    built_of_techniques = {r.name for r in STRATEGIES if r.techniques}
    assert built_of_techniques == set(EXPLAINED)
    assert built_of_techniques == {r.name for r in STRATEGIES if r.one_process_per_worker and not r.parameter_servers}
    for name in built_of_techniques:
        record = STRATEGIES[name]
        # The record's list is the very table the strategy's distribute applies, in its folder.
        table = importlib.import_module(f"stratagem.strategies.{name}.techniques").TECHNIQUES
        assert record.techniques == table and all(isinstance(t, Technique) for t in table), name


def test_a_record_whose_techniques_are_not_a_module_path_is_refused_with_the_path() -> None:
    with pytest.raises(
        InputError,
        match=r"names its techniques as 'stratagem\.module\.path:NAME'\. Received: "
        r"techniques_path='TECHNIQUES' for 'sharded'\. Write the module, a colon and the tuple's name\.",
    ):
        dataclasses.replace(STRATEGIES["sharded"], techniques_path="TECHNIQUES")


def test_each_record_builds_its_own_class_on_its_default_devices() -> None:
    registry = DeviceRegistry()
    for record in STRATEGIES:
        if record.parameter_servers:
            continue  # needs a cluster with parameter-server tasks (tests/test_ps_*.py)
        strategy, decision = build_strategy(record.name, registry=registry)
        try:
            assert type(strategy) is record.strategy_class, record.name
            assert decision.subject == "devices"
            explained = str(strategy.explain())
            if record.name in EXPLAINED:
                assert EXPLAINED[record.name] in explained, explained
            else:
                assert "techniques:" not in explained, explained
        finally:
            strategy.close()


def test_the_bench_entries_follow_their_records() -> None:
    assert BENCH_STRATEGIES["one_device"].max_replicas == 1
    assert BENCH_STRATEGIES["mirrored"].max_replicas is None
    assert [n for n, s in BENCH_STRATEGIES.items() if s.one_process_per_replica] == ["multi_worker", "sharded"]


def test_a_record_whose_class_is_not_a_module_path_is_refused_with_the_path() -> None:
    with pytest.raises(
        InputError,
        match=r"names its class as 'stratagem\.module\.path:ClassName'\. Received: "
        r"strategy_path='stratagem\.strategies\.mirrored\.MirroredStrategy' for 'mirrored'",
    ):
        dataclasses.replace(STRATEGIES["mirrored"], strategy_path="stratagem.strategies.mirrored.MirroredStrategy")


def _type_checking_names(module: object) -> set[str]:
    """The names a package imports under ``if TYPE_CHECKING:`` (for type checkers only)."""
    tree = ast.parse(Path(str(getattr(module, "__file__"))).read_text())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    return {a.asname or a.name for b in blocks for n in b.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_the_lazy_exports_are_the_records_classes_and_type_checkers_see_the_same_names() -> None:
    classes = {record.class_name for record in STRATEGIES}
    assert classes <= set(stratagem.__all__) and classes <= set(stratagem.strategies.__all__)
    for record in STRATEGIES:
        assert getattr(stratagem, record.class_name) is record.strategy_class, record.name
        assert getattr(stratagem.strategies, record.class_name) is record.strategy_class, record.name
    # The runtime tables are derived from the records; the imports for type checkers are written out, so they
    # are held to the same names here.
    assert _type_checking_names(stratagem) == set(stratagem._LAZY)
    assert _type_checking_names(stratagem.strategies) == set(stratagem.strategies.LAZY_NAMES)


def test_a_layout_map_goes_to_tensor_parallel_alone_and_is_refused_with_any_other_name() -> None:
    from stratagem.demo.digits import digits_layout_map

    with pytest.raises(InputError, match=r"Received: strategy 'mirrored' with a layout map\. Use tensor_parallel"):
        build_strategy("mirrored", layout_map=digits_layout_map())
