"""What the ranks of tests/test_sharded_module.py run: a DDP-style script's uses of the model ShardedStrategy hands
back (`model.module`, FSDP2's own methods, `clip_grad_norm_`, state dicts for torch.distributed.checkpoint)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from sharded_cases import batches, full, loss_fn, mlp
from torch import nn


def module_case(rank: int, ports: list[int]) -> dict[str, Any]:
    """ShardedStrategy over len(ports) workers: what `.module` is, and training written as for DDP (with
    `model.module` in it) against one device in float64."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import FSDPModule

    import stratagem as sg

    cluster = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    strategy = sg.ShardedStrategy(cluster=cluster, timeout=60)
    out: dict[str, Any] = {}
    try:
        data = batches(torch.float64)
        reference = mlp(torch.float64)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        user_model = copy.deepcopy(reference)
        model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1, momentum=0.9))
        out["module is FSDP2's"] = isinstance(model.module, FSDPModule) and model.module is user_model  # in place
        out["distributed_model is the model"] = strategy.distributed_model is model
        out["same parameters"] = [id(p) for p in model.parameters()] == [id(p) for p in model.module.parameters()]
        out["keys"] = (list(model.state_dict()), list(model.module.state_dict()), list(reference.state_dict()))
        out["repr"] = repr(model).split("(")[0]
        # torch.distributed.checkpoint reads the model handed back as it reads the FSDP2 module itself.
        wrapped_state, _ = get_state_dict(model, opt)
        module_state, _ = get_state_dict(model.module, opt)
        out["dcp keys"] = (sorted(wrapped_state), sorted(module_state))
        out["dcp same tensors"] = all(
            torch.equal(wrapped_state[k].to_local(), module_state[k].to_local()) for k in module_state
        )

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.module.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        for x, y in data:
            ref_loss = loss_fn(reference, x, y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        for x, y in strategy.distribute_dataset(data):
            strategy.run(step, args=(x, y))
        out["worst"] = max(
            float((full(p).detach() - q.detach()).abs().max() / q.detach().abs().max())
            for p, q in zip(model.module.parameters(), reference.parameters())
        )
        model.eval()
        out["eval reaches the module"] = (model.training, model.module.training)
        model.train()
        # FSDP2's own method through the model handed back, as a script written for FSDP2 calls it.
        model.set_requires_gradient_sync(False)
        model.set_requires_gradient_sync(True)
        whole = {k: full(v).detach() for k, v in model.module.state_dict().items()}
        out["whole state against one device"] = max(
            float((whole[k] - v).abs().max() / v.abs().max()) for k, v in reference_state().items()
        )
    finally:
        strategy.close()
    return out


def reference_state() -> dict[str, torch.Tensor]:
    """The MLP trained as in `module_case`, on one device."""
    reference: nn.Module = mlp(torch.float64)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(torch.float64):
        loss_fn(reference, x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


def several_models_case(rank: int, ports: list[int]) -> dict[str, Any]:
    """Two models and two optimizers in one step (tests/several_models_cases.py's DCGAN-style iteration, BatchNorm
    in both, a short last batch), and a student against a frozen teacher, under ShardedStrategy in float64: the
    worst relative error of every parameter and buffer against one device."""
    import several_models_cases as cases

    import stratagem as sg

    cluster = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    strategy = sg.ShardedStrategy(cluster=cluster, timeout=60)
    out: dict[str, Any] = {}
    try:
        user_g, d, opt_g, opt_d = cases.build_gan()
        # EMA copies of the generator, copied before it is sharded in place (as under FSDP2).
        ema_source, hand_source = cases.averaged(user_g), copy.deepcopy(user_g)
        g, opt_g = strategy.distribute(user_g, opt_g)
        d, opt_d = strategy.distribute(d, opt_d)
        for what, again in (("again", user_g), ("sharded", g.module)):
            try:
                strategy.distribute(again)
            except sg.InputError as error:
                out[f"{what} refused"] = str(error)
        # EMA copies of the generator, distributed like any model (not trained: no optimizer), updated after each step.
        ema = strategy.distribute(ema_source)
        hand = strategy.distribute(hand_source)
        teacher, student, opt_s = cases.build_distillation()
        teacher = strategy.distribute(teacher)
        student, opt_s = strategy.distribute(student, opt_s)
        gan_step = cases.gan_step(g, d, opt_g, opt_d)
        distillation_step = cases.distillation_step(teacher, student, opt_s)
        inside: list[str] = []

        def distribute_inside(real: torch.Tensor, _noise: torch.Tensor) -> torch.Tensor:
            try:
                strategy.distribute(nn.Linear(2, 2))
            except sg.InputError as error:
                inside.append(str(error))
            return real.sum()

        strategy.run(distribute_inside, args=cases.gan_batches()[0])
        out["inside refused"] = inside
        for real, noise in strategy.distribute_dataset(cases.gan_batches()):
            strategy.run(gan_step, args=(real, noise))
            ema.update_parameters(g)  # AveragedModel's own method, through the model handed back
            cases.lerp_ema_(hand, g)
            strategy.run(distillation_step, args=(real, noise))
        ref_g, ref_d, ref_ema, ref_hand = cases.reference_gan()
        out["ema"] = _worst(ema.state_dict(), ref_ema.state_dict())
        out["hand-written ema"] = _worst(hand.state_dict(), ref_hand.state_dict())
        _, ref_student = cases.reference_distillation()
        for name, got, want in (
            ("generator", g, ref_g),
            ("discriminator", d, ref_d),
            ("student", student, ref_student),
        ):
            out[name] = _worst(got.state_dict(), want.state_dict())
        out["explain"] = str(strategy.explain())
    finally:
        strategy.close()
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest |got - want| over max |want| of any floating tensor (counters compared exactly)."""
    assert list(got) == list(want), (list(got), list(want))
    worst = 0.0
    for key, expected in want.items():
        value = full(got[key]).detach()
        if not expected.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(value, expected) else float("inf"))
            continue
        worst = max(worst, float((value - expected).abs().max() / expected.abs().max().clamp_min(1e-300)))
    return worst
