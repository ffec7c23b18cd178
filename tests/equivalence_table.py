"""`python tests/equivalence_table.py`: the worst relative error against one device, per optimizer and
strategy, on the MLP of tests/cases.py in float64 (the figures behind tests/test_optimizers.py).

Relative error of a run: max over parameters of max|p - p_ref| / max|p_ref|.
"""

from __future__ import annotations

import sys

import torch
from cases import make_batches, train_reference, train_with
from test_optimizers import OPTIMIZERS, SIZES, STRATEGIES, _fresh


def worst_relative_error(reference: torch.nn.Module, model: torch.nn.Module) -> float:
    got = model.state_dict()
    worst = 0.0
    for name, want in reference.state_dict().items():
        if want.is_floating_point():
            scale = float(want.abs().max()) or 1.0
            worst = max(worst, float((got[name].to(want) - want).abs().max()) / scale)
    return worst


def main() -> int:
    names = list(STRATEGIES)
    print("| optimizer | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for opt_name in OPTIMIZERS:
        batches = make_batches((6,), torch.float64, sizes=SIZES)
        reference, ref_opt = _fresh(opt_name)
        train_reference(reference, ref_opt, batches)
        row = []
        for strategy_name in names:
            model, optimizer = _fresh(opt_name)
            strategy = STRATEGIES[strategy_name]()
            model, optimizer, _ = train_with(strategy, model, optimizer, batches)
            row.append(f"{worst_relative_error(reference, model):.1e}")
            strategy.close()
        print(f"| {opt_name} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
