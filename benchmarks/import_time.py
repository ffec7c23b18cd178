"""What `import stratagem` costs on top of `import torch`, in CPU and wall seconds, in this process.

    .venv/bin/python benchmarks/import_time.py        # one line; run it a few times and take the median

Also says whether the heavy modules that load only when used (torch._dynamo, grpc, torch.distributed.fsdp)
were imported; tests/test_architecture.py asserts that none is.
"""

from __future__ import annotations

import resource
import sys
import time


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    cpu0, wall0 = _cpu(), time.perf_counter()
    import torch  # noqa: F401

    cpu1, wall1 = _cpu(), time.perf_counter()
    import stratagem  # noqa: F401

    cpu2, wall2 = _cpu(), time.perf_counter()
    heavy = [m for m in ("torch._dynamo", "grpc", "torch.distributed.fsdp") if m in sys.modules]
    print(
        f"import torch: {cpu1 - cpu0:.3f} s CPU, {wall1 - wall0:.3f} s wall; "
        f"import stratagem on top: {cpu2 - cpu1:.3f} s CPU, {wall2 - wall1:.3f} s wall; "
        f"heavy modules loaded: {', '.join(heavy) or 'none'}"
    )


if __name__ == "__main__":
    main()
