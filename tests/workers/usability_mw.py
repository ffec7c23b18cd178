"""One worker of the usability multi-worker test, run under `stratagem launch --workers 2` with two
local replicas each: gather in global batch order, then (UW_FIT_DIR set) `fit` with the chief-only
callbacks. Each rank writes what it saw to UW_OUT/rank{N}.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from workers.common import multi_worker, setting  # noqa: E402

import stratagem as sg  # noqa: E402


def gather_checks(strategy: sg.MultiWorkerMirroredStrategy) -> dict:
    x = torch.arange(7.0).reshape(7, 1)  # 7 over 4 replicas: 2, 2, 2, 1
    (batch,) = list(strategy.distribute_dataset([x]))
    doubled = strategy.gather(strategy.run(lambda x: {"x2": x * 2, "n": torch.tensor(x.shape[0])}, args=(batch,)))
    names = strategy.gather(strategy.run(lambda x: [f"ex{int(v)}" for v in x.flatten()], args=(batch,)))
    ranks = strategy.gather(torch.tensor([float(strategy.cluster.rank)]))  # a plain value: once per worker
    return {"x2": doubled["x2"].flatten().tolist(), "n": doubled["n"].tolist(), "names": names, "ranks": ranks.tolist()}


def fit_checks(strategy: sg.MultiWorkerMirroredStrategy, out: Path) -> dict:
    """fit with every new callback, each writing under this rank's own directory: only the chief's may fill."""
    import torch.nn.functional as F
    from cases import build, make_batches

    mine = out / f"files{strategy.cluster.rank}"
    callbacks = [
        sg.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True),
        sg.callbacks.ModelCheckpoint(mine / "epoch{epoch}.safetensors", every_n_epochs=1, format="safetensors"),
        sg.callbacks.CSVLogger(mine / "log.csv"),
        sg.callbacks.TensorBoard(mine / "tb"),
    ]
    model, optimizer, shape = build("mlp", "sgd_momentum", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=[12, 11, 7, 5])
    history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=6, callbacks=callbacks)
    torch.save(history.model.state_dict(), out / f"state{strategy.cluster.rank}.pt")
    return {"epochs": len(history.epochs), "stopped": callbacks[0].stopped_epoch}


def main() -> int:
    strategy = multi_worker(2, 60)
    sg.seed_everything(11)
    seen = {"gather": gather_checks(strategy), "draw": float(torch.rand(1))}
    seen["fit"] = fit_checks(strategy, Path(setting("UW_OUT")))
    Path(setting("UW_OUT"), f"rank{strategy.cluster.rank}.json").write_text(json.dumps(seen))
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
