"""The files of a sharded backup, in one process: the manifest written last, every file's digest checked
(a flipped byte refused with the file and the rank that wrote it), the previous backup kept, a save that
dies before its manifest never loading, and a sharded backup read back as whole tensors.

The shards here come from `OneProcessShards`, which writes this process's whole state with
``torch.distributed.checkpoint`` and no process group, as rank 0; tests/test_backup_sharded.py runs the
real ShardedStrategy in several processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.strategies.sharded.checkpoint import by_name, by_position
from stratagem.strategies.state_shards import ShardFile, hash_file
from stratagem.train.backup.sharded import (
    MANIFEST,
    STATE,
    partial_directory,
    read_backup,
    read_whole,
    remove_stale_directories,
    save_sharded,
    verify_sharded,
)


class OneProcessShards:
    """Writes this process's model and optimizer tensors with DCP (no process group) as rank 0."""

    def __init__(self, fail_after_write: bool = False) -> None:
        self.fail_after_write = fail_after_write

    def save(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[ShardFile]:
        import torch.distributed.checkpoint as dcp

        positions = {str(i): dict(entry) for i, entry in optimizer.state_dict()["state"].items()}
        dcp.save({"model": model.state_dict(), "optimizer": positions}, checkpoint_id=directory, no_dist=True)
        if self.fail_after_write:
            raise OSError("killed after the shards were written")
        return [hash_file(p, 0) for p in sorted(directory.iterdir())]

    def load(self, *args: Any) -> None:
        raise AssertionError("not used: these tests read with read_whole")

    load_whole = load


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(5, 4, dtype=torch.float64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(backup_dir: Path, step: int, shards: Any = None, previous: bool = True) -> tuple[nn.Module, Any]:
    model, optimizer = trained(step)
    state = {
        "kind": "fit",
        "step": step,
        "epoch": 0,
        "step_in_epoch": step,
        "strategy": "OneProcess",
        "num_processes": 1,
        "optimizer_param_groups": optimizer.state_dict()["param_groups"],
    }
    save_sharded(
        backup_dir / "backup.dcp",
        shards or OneProcessShards(),
        model,
        optimizer,
        state,
        step=step,
        is_chief=True,
        previous=backup_dir / "backup.previous.dcp" if previous else None,
    )
    return model, optimizer


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_newest_and_the_previous_backup_are_kept_each_with_a_manifest_listing_every_file(tmp_path):
    save(tmp_path, 3)
    save(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.dcp", "backup.previous.dcp"]
    assert read_backup(tmp_path / "backup.dcp")[0] == 6
    assert read_backup(tmp_path / "backup.previous.dcp")[0] == 3
    manifest = json.loads((tmp_path / "backup.dcp" / MANIFEST).read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 1 and manifest["strategy"] == "OneProcess"
    listed = {entry["name"] for entry in manifest["files"]}
    assert listed == {p.name for p in (tmp_path / "backup.dcp").iterdir()} - {MANIFEST}
    assert {".metadata", "__0_0.distcp", STATE} <= listed
    save(tmp_path, 9, previous=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.dcp", "backup.previous.dcp"]
    assert read_backup(tmp_path / "backup.dcp")[0] == 9  # the one at 6 replaced, the previous one untouched
    assert read_backup(tmp_path / "backup.previous.dcp")[0] == 3


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", STATE])
@pytest.mark.parametrize("where", [0.1, 0.6])
def test_a_flipped_byte_in_any_file_is_refused_naming_the_file_and_the_rank_that_wrote_it(tmp_path, name, where):
    save(tmp_path, 3)
    path = tmp_path / "backup.dcp" / name
    flip_byte(path, int(path.stat().st_size * where))
    with pytest.raises(sg.CorruptCheckpointError) as refused:
        verify_sharded(tmp_path / "backup.dcp")
    assert f"its file {name!r} (written by rank 0) differs from what was written" in str(refused.value)
    assert str(tmp_path / "backup.dcp") in str(refused.value)


def test_a_missing_file_or_manifest_is_refused(tmp_path):
    save(tmp_path, 3)
    (tmp_path / "backup.dcp" / "__0_0.distcp").unlink()
    with pytest.raises(sg.CorruptCheckpointError, match=r"its file '__0_0.distcp' \(written by rank 0\) is missing"):
        verify_sharded(tmp_path / "backup.dcp")
    (tmp_path / "backup.dcp" / MANIFEST).unlink()
    with pytest.raises(sg.CorruptCheckpointError, match="it has no manifest.json"):
        verify_sharded(tmp_path / "backup.dcp")


def test_a_save_that_dies_before_its_manifest_leaves_the_backups_before_it_and_its_leftovers_are_removed(tmp_path):
    save(tmp_path, 3)
    with pytest.raises(OSError, match="killed after the shards were written"):
        save(tmp_path, 6, shards=OneProcessShards(fail_after_write=True))
    partial = partial_directory(tmp_path / "backup.dcp", 6)
    assert partial.is_dir() and not (partial / MANIFEST).exists()
    assert read_backup(tmp_path / "backup.dcp")[0] == 3  # untouched
    mine_elsewhere = tmp_path / ".stratagem-partial.backup.pt.0123456789abcdef.tmp"
    other = tmp_path / ".stratagem-partial.someone-else.0123456789abcdef.tmp"
    mine_elsewhere.write_bytes(b"a single-file temporary is not a directory")
    other.mkdir()
    assert remove_stale_directories(tmp_path, ("backup.dcp", "backup.previous.dcp")) == [partial]
    assert other.is_dir() and mine_elsewhere.is_file() and (tmp_path / "backup.dcp").is_dir()


def test_a_sharded_backup_reads_back_as_whole_tensors_that_load_into_a_plain_model_and_optimizer(tmp_path):
    model, optimizer = save(tmp_path, 4)
    state, model_state, optimizer_state = read_whole(tmp_path / "backup.dcp")
    assert state["step"] == 4
    fresh_model, fresh_optimizer = trained(0)
    fresh_model.load_state_dict(model_state)
    fresh_optimizer.load_state_dict(optimizer_state)
    for a, b in zip(fresh_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    expected = optimizer.state_dict()
    got = fresh_optimizer.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_optimizer_state_by_position_and_back_by_name():
    names = ["0.weight", "0.bias", "2.weight"]
    state = {"state": {"0.bias": {"exp_avg": torch.ones(2)}}, "param_groups": [{"params": names, "lr": 0.1}]}
    positions = by_position(state, names)
    assert list(positions) == ["1"]
    back = by_name(positions, [{"params": [0, 1, 2], "lr": 0.1}], names)
    assert back["param_groups"] == [{"params": names, "lr": 0.1}] and list(back["state"]) == ["0.bias"]
    with pytest.raises(sg.InputError, match="The checkpoint's optimizer has 2 parameters and this run's has 3"):
        by_name(positions, [{"params": [0, 1], "lr": 0.1}], names)
    with pytest.raises(sg.InputError, match=r"values other than tensors in its state \(\['note'\]"):
        by_position({"state": {"0.bias": {"note": "x"}}, "param_groups": []}, names)


def test_checkpoint_inspect_verify_and_export_read_a_sharded_backup(tmp_path, capsys):
    from stratagem.cli.main import main

    save(tmp_path, 3)
    model, _ = save(tmp_path, 6)
    assert main(["checkpoint", "inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    newest, previous = report["files"]
    assert (newest["name"], newest["step"], newest["num_processes"]) == ("backup.dcp", 6, 1)
    assert (previous["name"], previous["step"]) == ("backup.previous.dcp", 3)
    assert {(s["name"], s["rank"]) for s in newest["shards"]} >= {("__0_0.distcp", 0), (".metadata", 0)}
    assert newest["parts"] == {"rank 0": sum(s["num_bytes"] for s in newest["shards"])}
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    assert "    rank 0: __0_0.distcp  " in capsys.readouterr().out

    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "model.pt")]) == 0
    assert "(step 6, epoch 1)" in capsys.readouterr().out
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())

    assert main(["checkpoint", "verify", str(tmp_path)]) == 0
    assert "backup.dcp" in capsys.readouterr().out
    flip_byte(tmp_path / "backup.previous.dcp" / "__0_0.distcp", 100)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "backup.previous.dcp" in out and "its file '__0_0.distcp' (written by rank 0) differs" in out
    assert main(["checkpoint", "verify", str(tmp_path / "backup.dcp")]) == 0  # one sharded backup alone
    capsys.readouterr()


def test_export_to_one_torch_file_and_back_to_a_sharded_checkpoint(tmp_path, capsys):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from stratagem.cli.main import main

    model, _ = save(tmp_path / "backup", 4)
    assert main(["checkpoint", "export", str(tmp_path / "backup"), str(tmp_path / "model.pt")]) == 0
    assert main(["checkpoint", "export", str(tmp_path / "model.pt"), str(tmp_path / "model.dcp")]) == 0
    assert f"wrote the model of {tmp_path / 'model.pt'} to {tmp_path / 'model.dcp'}" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path / "model.dcp")]) == 0
    assert "ok (" in capsys.readouterr().out
    back: dict[str, Any] = {}
    _load_state_dict(
        back,
        storage_reader=FileSystemReader(tmp_path / "model.dcp"),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    assert back["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    assert main(["checkpoint", "export", str(tmp_path / "model.pt"), str(tmp_path / "model.dcp")]) == 2
    assert "The export target exists" in capsys.readouterr().err
