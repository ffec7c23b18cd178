"""`stratagem train --json` prints exactly one JSON document on standard output under every strategy.

The strategies that run in this process are checked here, through the CLI's main(); those that
relaunch the command as a cluster (multi_worker --workers 2, parameter_server) are checked in
tests/test_cli_train.py, whose launcher tests parse their whole standard output the same way."""

from __future__ import annotations

import json

import pytest

from stratagem.cli.main import main
from stratagem.strategies.by_name import STRATEGY_NAMES

IN_PROCESS = {
    "mirrored": "MirroredStrategy",
    "one_device": "OneDeviceStrategy",
    "central_storage": "CentralStorageStrategy",
    "model_parallel": "ModelParallelStrategy",
    "multi_worker": "MultiWorkerMirroredStrategy",
    "sharded": "ShardedStrategy",
    "tensor_parallel": "TensorParallelStrategy",
}  # multi_worker, sharded and tensor_parallel alone: a cluster of one, no relaunch


def test_every_strategy_of_the_command_is_covered():
    assert set(STRATEGY_NAMES) == set(IN_PROCESS) | {"parameter_server"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", list(IN_PROCESS))
def test_json_is_one_document_on_stdout(capfd, strategy):
    code = main(["train", "--json", "--strategy", strategy, "--epochs", "1", "--batch-size", "256"])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    summary = json.loads(out)  # the whole of standard output, nothing before or after
    assert summary["strategy"] == IN_PROCESS[strategy]
    assert summary["num_train_examples"] == 1437
    # A cluster of one has no peers to be slower than; the key is there for the workers' stragglers.
    assert summary.get("stragglers", "absent") == ([] if strategy == "multi_worker" else "absent")
    if strategy == "tensor_parallel":
        # By name alone it split nothing: the command gives the digits net's layouts (demo.DIGITS_LAYOUTS).
        layouts = next(d for d in summary["explanation"]["decisions"] if d["subject"] == "layouts")
        assert layouts["choice"] == "3 parameter(s) split, 5 replicated", layouts
