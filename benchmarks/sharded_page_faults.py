"""Where stage 2's extra CPU goes on one host: minor page faults and user/system CPU per step, ShardedStrategy(stage=2)
against MultiWorkerMirroredStrategy, each under `stratagem launch --workers 2` (12 x Linear(1024, 1024), AdamW, global
batch 64, 3 warm-up and 10 counted steps; one JSON line per rank).

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_page_faults.py run
    MALLOC_MMAP_THRESHOLD_=33554432 PYTHONPATH=src .venv/bin/python benchmarks/sharded_page_faults.py run
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 PYTHONPATH=src .venv/bin/python benchmarks/sharded_page_faults.py run

Page faults and CPU seconds hold under load better than wall time (issue 39, item 6).
"""

import json
import os
import resource
import sys

import torch
from torch import nn

import stratagem as sg


def main(kind):
    strategy = sg.ShardedStrategy(stage=2) if kind == "sharded2" else sg.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    model, opt = strategy.distribute(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)) for _ in range(4)]

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    batches = list(strategy.distribute_dataset(data))
    for i in range(3):
        strategy.run(step, args=batches[i % 4])
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(10):
        strategy.run(step, args=batches[i % 4])
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(
        "FAULTS "
        + json.dumps(
            {
                "kind": kind,
                "env": os.environ.get("MALLOC_MMAP_THRESHOLD_", "strategy's"),
                "minflt_per_step": (r1.ru_minflt - r0.ru_minflt) / 10,
                "user_ms": (r1.ru_utime - r0.ru_utime) * 100,
                "sys_ms": (r1.ru_stime - r0.ru_stime) * 100,
            }
        ),
        flush=True,
    )
    strategy.close()


if __name__ == "__main__":
    if sys.argv[1] == "run":
        from stratagem import environ
        from stratagem.cluster import launch

        for kind in ("sharded2", "multi_worker"):
            lines = []
            launch(
                [sys.executable, __file__, kind],
                workers=2,
                env=dict(environ.current()),
                sink=lambda line: lines.append(line.text),
                timeout=300,
            )
            for t in lines:
                if "FAULTS " in t:
                    print(t.split("FAULTS ", 1)[1])
    else:
        main(sys.argv[1])
