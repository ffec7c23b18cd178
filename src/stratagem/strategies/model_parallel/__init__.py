"""ModelParallelStrategy: one model split into stages on several devices, micro-batches pipelined (GPipe).

`strategy` is the strategy; `split` cuts an `nn.Sequential` into stages; `pipeline` runs them.
"""
