"""A training script that changes its model between steps, as fine-tuning and research scripts do, run on one
device (the reference) and through the model a strategy's `distribute` returned (issue 38, item 1).

Between steps it sets a flag on the model that its forward reads (`use_aux`, toggled every step), freezes a layer
reached through the model (`model.body[0].requires_grad_(False)`), sets and later deletes an attribute of a
submodule (`model.head.scale`), registers a buffer the forward adds (`model.shift`), writes a bias in place under
`torch.no_grad()`, and before the first step re-initializes every Linear through `model.apply(init_fn)` with
random draws. Every change is made to the model `distribute` returned; on one device that is the model itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from cases import make_batches
from torch import nn

DTYPE = torch.float64
STEPS = 5


class FlagNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        if self.use_aux:
            out = out + 0.5 * self.aux(h)
        shift = getattr(self, "shift", None)  # a buffer registered after distribute
        if shift is not None:
            out = out + shift
        return out * getattr(self.head, "scale", 1.0)


MODEL_CLASSES = [FlagNet, nn.Sequential, nn.Linear, nn.Tanh]
"""What `torch.load(weights_only=True)` must be allowed to build a FlagNet: its classes, nothing of stratagem."""


def init_weights(module: nn.Module) -> None:
    """GPT-2 style initialization, applied to the whole model after construction: random draws."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.2)
        nn.init.zeros_(module.bias)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = FlagNet().to(DTYPE)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def change_before(model: nn.Module, step: int) -> None:
    """What the script does to `model` before step `step` (0-based), outside the step."""
    if step == 0:
        torch.manual_seed(11)
        model.apply(init_weights)
    model.use_aux = step % 2 == 0
    if step == 2:
        model.body[0].requires_grad_(False)
    if step == 3:
        model.head.scale = 0.5
        model.register_buffer("shift", torch.full((4,), 0.1, dtype=DTYPE))
    if step == 4:
        del model.head.scale
        with torch.no_grad():
            model.head.bias.fill_(0.05)


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches((6,), DTYPE)[:STEPS]


def train_reference() -> tuple[nn.Module, torch.Tensor]:
    """The script on one device; also the frozen layer's weight when it was frozen."""
    model, optimizer = build()
    step = make_step(model, optimizer)
    frozen = torch.empty(0)
    for k, (x, y) in enumerate(batches()):
        change_before(model, k)
        if k == 2:
            frozen = model.body[0].weight.detach().clone()
        step(x, y)
    return model, frozen


def train_with(strategy, dataset=None) -> tuple[nn.Module, torch.Tensor]:
    """The same script under `strategy`, every change made to the model `distribute` returned."""
    model, optimizer = build()
    model, optimizer = strategy.distribute(model, optimizer)
    step = make_step(model, optimizer)
    frozen = torch.empty(0)
    data = strategy.distribute_dataset(batches()) if dataset is None else dataset
    for k, (x, y) in enumerate(data):
        change_before(model, k)
        if k == 2:
            frozen = model.body[0].weight.detach().clone()
        strategy.run(step, args=(x, y))
    return model, frozen


def _cluster(rank: int, ports: tuple[int, int]) -> dict:
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def workers_case(rank: int, ports: list[int]) -> bytes:
    """On each of two worker processes: the script under MultiWorkerMirrored with one and with two local replicas,
    then under ShardedStrategy; each strategy at its own pair of ports (a closed store's port may linger)."""
    import io

    import stratagem as sg
    from stratagem.devices import DeviceRegistry

    torch.set_num_threads(1)
    out: dict = {}
    for local, pair in ((1, ports[0:2]), (2, ports[2:4])):
        registry = DeviceRegistry()
        registry.set_logical_device_configuration("cpu", 2)
        devices = [f"cpu:{i}" for i in range(local)]
        strategy = sg.MultiWorkerMirroredStrategy(devices, cluster=_cluster(rank, pair), timeout=60, registry=registry)
        try:
            model, frozen = train_with(strategy)
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            with torch.serialization.safe_globals(MODEL_CLASSES):
                loaded = torch.load(buffer, weights_only=True)
            out[f"mwms-{local}"] = {
                "replicas": [{k: v.clone() for k, v in r.state_dict().items()} for r in model.replicas],
                "flags": [(r.use_aux, hasattr(r.head, "scale")) for r in model.replicas],
                "frozen": frozen,
                "requires_grad": [[p.requires_grad for p in r.body[0].parameters()] for r in model.replicas],
                "loaded": (type(loaded).__name__, {k: v.clone() for k, v in loaded.state_dict().items()}),
            }
        finally:
            strategy.close()
    strategy = sg.ShardedStrategy(cluster=_cluster(rank, ports[4:6]), timeout=60)
    try:
        model, frozen = train_with(strategy)
        out["sharded"] = {
            "state": {k: _full(v).detach().clone() for k, v in model.state_dict().items()},
            "flags": [(model.module.use_aux, hasattr(model.module.head, "scale"))],
            "frozen": _full(frozen),
            "requires_grad": [[p.requires_grad for p in model.module.body[0].parameters()]],
        }
        try:
            torch.save(model, io.BytesIO())
            out["sharded pickle"] = "saved"
        except sg.InputError as error:
            out["sharded pickle"] = str(error)
    finally:
        strategy.close()
    # Bytes, not tensors: the queue back to the test would share tensors through file descriptors of a process that
    # has ended by then.
    payload = io.BytesIO()
    torch.save(out, payload)
    return payload.getvalue()
