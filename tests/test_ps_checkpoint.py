"""The parameter-server checkpoint's composition, without servers: shards joined into whole parameters and
cut again for another placement, with the values written out by hand."""

from __future__ import annotations

import pytest
import torch

from stratagem.errors import InputError
from stratagem.strategies.parameter_server import checkpoint
from stratagem.strategies.parameter_server.partitioners import Shard

# w (3 rows) cut in two over two servers: rows 0..1 on ps:0, row 2 on ps:1; b whole on ps:1.
W0 = Shard(name="w/part_0", parameter="w", ps=0, start=0, stop=2, group=0)
W1 = Shard(name="w/part_1", parameter="w", ps=1, start=2, stop=3, group=0)
B = Shard(name="b", parameter="b", ps=1, start=0, stop=2, group=0)


def _replies() -> dict[int, checkpoint.Reply]:
    # What each server's Save answers: values and per-row state by shard name, scalars in meta.
    ps0 = {
        "w/part_0": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "w/part_0#momentum": torch.tensor([[0.1, 0.2], [0.3, 0.4]]),
    }
    ps1 = {
        "w/part_1": torch.tensor([[5.0, 6.0]]),
        "w/part_1#momentum": torch.tensor([[0.5, 0.6]]),
        "b": torch.tensor([7.0, 8.0]),
    }
    return {
        0: ("save", {"scalars": {"w/part_0": {"step": 3}}}, ps0),
        1: ("save", {"scalars": {"w/part_1": {"step": 3}, "b": {"step": 3}}}, ps1),
    }


def test_join_state_puts_the_rows_of_each_parameter_and_its_state_back_together():
    state = checkpoint.join_state([W0, W1, B], _replies())
    assert state["format"] == checkpoint.CHECKPOINT_FORMAT
    assert torch.equal(state["variables"]["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    assert torch.equal(state["variables"]["b"], torch.tensor([7.0, 8.0]))
    assert torch.equal(state["optimizer_state"]["w"]["momentum"], torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]))
    assert state["optimizer_state"]["w"]["step"] == 3 and state["optimizer_state"]["b"] == {"step": 3}


def test_shard_state_cuts_a_checkpoint_for_another_placement():
    state = checkpoint.join_state([W0, W1, B], _replies())
    # Another placement: w's last two rows on one server.
    tail = Shard(name="w/part_1", parameter="w", ps=0, start=1, stop=3, group=0)
    tensors, scalars = checkpoint.shard_state(state, [tail])
    assert sorted(tensors) == ["w/part_1", "w/part_1#momentum"]
    assert torch.equal(tensors["w/part_1"], torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert torch.equal(tensors["w/part_1#momentum"], torch.tensor([[0.3, 0.4], [0.5, 0.6]]))
    assert scalars == {"w/part_1": {"step": 3}}


def test_a_checkpoint_without_a_parameter_of_the_model_is_refused():
    state = checkpoint.join_state([B], {1: _replies()[1]})
    with pytest.raises(
        InputError,
        match=r"The checkpoint lacks parameters of this model\. Received: missing \['w'\]\. "
        r"Restore a checkpoint written for this model\.",
    ):
        checkpoint.check_covers(state, [W0, W1, B])


def test_write_then_read_gives_the_same_checkpoint(tmp_path):
    state = checkpoint.join_state([W0, W1, B], _replies())
    checkpoint.write(state, tmp_path / "ps.pt")
    back = checkpoint.read(tmp_path / "ps.pt")
    assert not (tmp_path / "ps.pt.tmp").exists()
    assert torch.equal(back["variables"]["w"], state["variables"]["w"])
    assert back["optimizer_state"]["b"] == {"step": 3}
