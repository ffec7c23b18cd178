"""Models compiled with `torch.compile` before `distribute`: room for every replica's compiled code.

Every replica runs the same `forward` code, and torch.compile keeps the compiled versions of one code
object in one cache, each guarded on the module it was compiled for. With N replicas the cache fills
N times as fast as on one device (each replica compiles for its first shape, then a dynamic one, then
an empty slice...), and past `torch._dynamo.config.recompile_limit` (8 by default) torch runs the
forward in eager mode for good, logging a warning: on 3 logical CPUs, 10 different batch sizes were
enough. So `distribute` gives each replica the budget one device has, raising the limit to N times
its value (never lowering it), and `explain()` says so.
"""

from __future__ import annotations

import sys

from torch import nn

from stratagem.diagnose import PlacementDecision


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` is what `torch.compile(module)` returns."""
    # Not imported here: importing dynamo costs about 2 s, and a model can only be compiled once it is loaded.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


_applied: int | None = None
"""The limit this module last set; a different value found later is the user's own."""
_base = 8
"""The limit before this module raised it: the budget each replica gets."""


def make_room_for_replicas(model: nn.Module, num_replicas: int) -> PlacementDecision | None:
    """For a compiled model with several replicas: raises dynamo's recompile limit and says why."""
    global _applied, _base
    if num_replicas < 2 or not is_compiled(model):
        return None
    import torch._dynamo.config as dynamo_config

    current = int(dynamo_config.recompile_limit)
    if _applied is None or current != _applied:
        _base = current
    wanted = max(current, _base * num_replicas)
    dynamo_config.recompile_limit = wanted
    _applied = wanted
    return PlacementDecision(
        subject="torch.compile",
        choice=f"recompile limit {wanted} (at least {_base} per replica)",
        reason=(
            f"the {num_replicas} replicas share one cache of compiled code, each entry guarded on its own "
            f"replica's module; with torch's limit of {_base} the later replicas would fall back to eager "
            "mode for good"
        ),
    )
