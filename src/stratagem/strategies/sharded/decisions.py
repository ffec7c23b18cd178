"""What `ShardedStrategy.explain()` says of its own choices: the stage, the gradient combination, the batch check."""

from __future__ import annotations

from stratagem.diagnose import PlacementDecision


def sharded_decisions(stage: int, *, check_batches: bool) -> tuple[list[PlacementDecision], list[PlacementDecision]]:
    """The decisions said before the units' (the stage) and after them (the gradient combination, the batch check)."""
    before = [
        PlacementDecision(
            subject="sharding stage",
            choice=f"stage {stage}",
            reason="parameters, gradients and optimizer state sharded; each unit gathered for forward and "
            "again for backward (ZeRO-3)"
            if stage == 3
            else "parameters, gradients and optimizer state sharded at rest; gathered parameters kept from "
            "forward to backward (reshard_after_forward=False): one all-gather per step, peak = whole model",
        )
    ]
    after = [
        PlacementDecision(
            subject="gradient combination",
            choice="reduce-scatter of SUM, each rank pre-scaled by its share of the global batch",
            reason="FSDP2's AVG is the mean of per-rank means, off for uneven splits; Gloo has no PREMUL_SUM",
        ),
        PlacementDecision(
            subject="batch check",
            choice="on (check_batches=True)" if check_batches else "off (check_batches=False)",
            reason="each worker's fingerprint of the step and its global batch rides the step's first gradient "
            "reduce-scatter and is compared when it lands, before any update (alone when the step has none)"
            if check_batches
            else "the fingerprints are still sent, empty, so a worker with the check on names this one",
        ),
    ]
    return before, after
