"""Sharded data parallelism (ZeRO stages 2 and 3) on FSDP2, in the order `strategy.py` applies the parts:

- `techniques.py`: the strategy's table of techniques, one: data sharding along `data`, which applies the next two;
- `units.py`: how the model is cut into the units gathered one at a time, and `fully_shard` applied;
- `weighting.py`: gradients reduce-scattered as a SUM pre-scaled by each rank's share (exact on any split);
- `memory.py`: the bytes each rank holds, by category, before the first step;
- `checks.py`: what is refused before anything is built (LBFGS, CUDA on Gloo, a stepped optimizer), and a rank
  whose shards differ from the plan (one all-gather of shapes and dtypes before the first step);
- `agreement.py`: the workers' batch check (`check_batches`), riding each step's first gradient reduce-scatter;
- `decisions.py`: what `explain()` says of the stage, the gradient combination and the batch check.

The package imports nothing when it is imported: the class is `strategy.ShardedStrategy` (`sg.ShardedStrategy`),
so a module of it (`memory.py`, `placement.py`) is read without the strategy and what it imports.
"""
