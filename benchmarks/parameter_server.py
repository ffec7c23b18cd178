"""Issue 4's benchmarks: parameter-server transport against a bare gRPC echo, and training samples/s.

    .venv/bin/python benchmarks/parameter_server.py                       # everything
    .venv/bin/python benchmarks/parameter_server.py --repeats 5 --steps 60 --skip-training

Transport: one parameter server in its own process; this process is the worker. One round is a
pull of every shard (one call) plus a push of a gradient for every shard (one call; the server
applies plain SGD), so 2x the model's bytes move. The echo, served by the same process
with grpcio alone (no token, no wire format), sends the same bytes in the same chunks and gets
them back. Two models: 64 MiB (16 tensors of 4 MiB) and 500 tensors of 4 KiB. Goal: >= 0.8x echo.
The round runs two ways: as a worker on the server's host does by default (through shared memory,
one small gRPC call each way), and with ``shared_memory=False``, as a worker on another host does
(every byte in gRPC messages over loopback).
For reference, the same bytes also go as two calls of bare grpcio, the kinds a pull and a push use
(a "source" that returns them, a "sink" that takes them): what two calls cost before any work of
stratagem's. Rounds of the three alternate; each ratio is the median over neighbouring rounds.

Training: the MLP workload of shared/peers/README.md (global batch 256, SGD momentum 0.9) under
``stratagem launch --workers W --ps 1`` (worker 0 works inside the chief), W = 1 and 2, by default
(shared memory, all tasks on this host) and with ``shared_memory=False``, against a plain PyTorch
loop in this process measured at the start of the same round; each figure is the median over
``--rounds`` rounds of its ratio to that round's plain loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.partitioners import place
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import (
    _CHANNEL_OPTIONS,
    _CLIENT_OPTIONS,
    Security,
)
from stratagem.strategies.parameter_server.variables import ShardedVariables

ECHO = "/bench.Echo/Echo"
TOKEN = "bench-token"


def _serve(ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """The parameter-server process: one ParameterServer and one bare echo service."""
    from concurrent import futures

    torch.set_num_threads(1)
    ps = ParameterServer(security=Security(token=TOKEN), task="ps:0")
    echo = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_CHANNEL_OPTIONS)
    kept: list[bytes] = []  # what the sink took last, which the source sends

    def sink(requests, context) -> bytes:
        kept[:] = [requests] if isinstance(requests, bytes) else list(requests)
        return b""

    echo.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Echo",
                {
                    "Echo": grpc.stream_stream_rpc_method_handler(lambda requests, context: requests),
                    "Sink": grpc.stream_unary_rpc_method_handler(sink),
                    "Sink1": grpc.unary_unary_rpc_method_handler(sink),
                    "Source": grpc.unary_stream_rpc_method_handler(lambda request, context: iter(kept)),
                },
            )
        ]
    )
    port = echo.add_insecure_port("127.0.0.1:0")
    echo.start()
    ready.put((ps.address, f"127.0.0.1:{port}"))
    stop.wait(3600)
    echo.stop(0)
    ps.stop()


def _alternating_seconds(*fns, repeats: int) -> list[list[float]]:
    """Times of each of ``fns`` run in turn, so a change of load on the machine hits them all."""
    for fn in fns:  # warm-up: connections, allocations
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def transport(repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    server = context.Process(target=_serve, args=(ready, stop), daemon=True)
    server.start()
    try:
        ps_address, echo_address = ready.get(timeout=120)
        channel = grpc.insecure_channel(echo_address, options=_CLIENT_OPTIONS)
        echo = channel.stream_stream(ECHO)
        source, sink = channel.unary_stream("/bench.Echo/Source"), channel.stream_unary("/bench.Echo/Sink")
        sink_1 = channel.unary_unary("/bench.Echo/Sink1")
        out = {}
        for name, shapes in (("64MiB_16x4MiB", [(1024, 1024)] * 16), ("500x4KiB", [(1024,)] * 500)):
            params = {f"p{i}": torch.randn(shape) for i, shape in enumerate(shapes)}
            model_bytes = sum(p.numel() * 4 for p in params.values())
            shards = place([(n, p, 0) for n, p in params.items()], 1, None)
            variables = ShardedVariables(shards, [ps_address], security=Security(token=TOKEN), rpc_timeout=120)
            variables.create(params, torch.optim.SGD(list(params.values()), lr=1e-6))
            over_grpc = ShardedVariables(
                shards, [ps_address], security=Security(token=TOKEN), rpc_timeout=120, shared_memory=False
            )
            grads = {n: torch.randn_like(p) * 1e-3 for n, p in params.items()}
            local = {n: torch.empty_like(p) for n, p in params.items()}
            variables.arrange(local)  # as a worker keeps its copy of the model: one buffer per bucket

            def round_trip(variables=variables, local=local, grads=grads) -> None:
                variables.pull_into(local)
                variables.push(grads)

            def grpc_trip(variables=over_grpc, local=local, grads=grads) -> None:
                variables.pull_into(local)
                variables.push(grads)

            pieces = wire.encode_chunks("push", None, grads)  # the pieces one push carries
            payload_bytes = sum(len(piece) for piece in pieces)

            def echo_trip(pieces=pieces, payload_bytes=payload_bytes) -> None:
                got = sum(len(piece) for piece in echo(iter(pieces), timeout=120))
                assert got == payload_bytes

            def bare_trip(pieces=pieces, payload_bytes=payload_bytes) -> None:
                if len(pieces) == 1:
                    sink_1(pieces[0], timeout=120)
                else:
                    sink(iter(pieces), timeout=120)
                assert sum(len(piece) for piece in source(b"", timeout=120)) == payload_bytes  # what the sink took

            ps_times, grpc_times, echo_times, bare_times = _alternating_seconds(
                round_trip, grpc_trip, echo_trip, bare_trip, repeats=repeats
            )
            ps_s, grpc_s, echo_s, bare_s = (
                statistics.median(t) for t in (ps_times, grpc_times, echo_times, bare_times)
            )
            # The ratio of each set of neighbouring rounds, then the median: noise on a shared machine
            # comes in bursts, which this keeps from landing on one side only.
            ratios = [(2 * model_bytes / p) / (2 * payload_bytes / e) for p, e in zip(ps_times, echo_times)]
            grpc_ratios = [(2 * model_bytes / p) / (2 * payload_bytes / e) for p, e in zip(grpc_times, echo_times)]
            bare_ratios = [e / b for e, b in zip(echo_times, bare_times)]
            out[name] = {
                "model_bytes": model_bytes,
                "ps_s": ps_s,
                "grpc_s": grpc_s,
                "echo_s": echo_s,
                "bare_s": bare_s,
                "ps_bytes_per_s": 2 * model_bytes / ps_s,
                "grpc_bytes_per_s": 2 * model_bytes / grpc_s,
                "echo_bytes_per_s": 2 * payload_bytes / echo_s,
                "transfers": variables.transfers["ps:0"],
                "ratio": statistics.median(ratios),
                "pair_ratios": ratios,
                "grpc_ratio": statistics.median(grpc_ratios),
                "grpc_pair_ratios": grpc_ratios,
                "bare_ratio": statistics.median(bare_ratios),
            }
            print(
                f"{name}: pull+push {ps_s * 1e3:.1f} ms ({variables.transfers['ps:0'].split(':')[0]}), over gRPC "
                f"{grpc_s * 1e3:.1f} ms, echo {echo_s * 1e3:.1f} ms, bare source+sink {bare_s * 1e3:.1f} ms; ratio "
                f"{out[name]['ratio']:.3f}, over gRPC {out[name]['grpc_ratio']:.3f} (bare {out[name]['bare_ratio']:.3f})",
                file=sys.stderr,
            )
            variables.close()
            over_grpc.close()
        channel.close()
        return out
    finally:
        stop.set()
        server.join(30)


# ---- training: this file is also the script every task of the launched cluster runs ----------
def mlp_batches():
    from stratagem.bench.workloads import WORKLOADS

    return itertools.cycle(WORKLOADS["mlp"].make_batches())


def _train_task() -> None:
    """Runs on every task under `stratagem launch`; the chief writes samples/s to BENCH_PS_OUT."""
    global _model, _optimizer
    import stratagem as sg
    from stratagem.bench.workloads import WORKLOADS

    workload = WORKLOADS["mlp"]
    warmup, steps = int(os.environ["BENCH_PS_WARMUP"]), int(os.environ["BENCH_PS_STEPS"])
    net = workload.build_model()
    strategy = sg.ParameterServerStrategy(
        ps_exit_delay=5.0, shared_memory=None if os.environ["BENCH_PS_SHARED"] == "1" else False
    )
    _model, _optimizer = strategy.distribute(net, workload.build_optimizer(net))
    coordinator = sg.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(mlp_batches))
    for _ in range(warmup):
        coordinator.schedule(train_step, args=(iterator,))  # workers start serving here
    coordinator.join()
    start = time.perf_counter()
    losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    elapsed = time.perf_counter() - start
    Path(os.environ["BENCH_PS_OUT"]).write_text(
        json.dumps(
            {
                "workers": strategy.num_workers,
                "samples_per_s": steps * workload.global_batch / elapsed,
                "last_loss": float(losses[-1].fetch()),
            }
        )
    )
    strategy.shutdown()


_model = _optimizer = None  # the distributed model and optimizer, set by _train_task on every task


def train_step(iterator):
    import torch.nn.functional as F

    x, y = next(iterator)
    loss = F.cross_entropy(_model(x), y)
    loss.backward()
    _optimizer.step()
    _optimizer.zero_grad()
    return loss


def plain_samples_per_s(warmup: int, steps: int, threads: int | None = None) -> float:
    """A plain PyTorch loop on the same workload in this process (``threads``: torch's intra-op threads)."""
    import torch.nn.functional as F

    from stratagem.bench.workloads import WORKLOADS

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _plain_loop(WORKLOADS["mlp"], warmup, steps, F)
    finally:
        torch.set_num_threads(before)


def _plain_loop(workload, warmup: int, steps: int, F) -> float:

    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    batches = itertools.cycle(workload.make_batches())
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps * workload.global_batch / (time.perf_counter() - start)


def training(workers: int, warmup: int, steps: int, shared_memory: bool = True) -> dict:
    from stratagem import environ
    from stratagem.cluster import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(
            environ.current(),
            BENCH_PS_OUT=str(out),
            BENCH_PS_WARMUP=str(warmup),
            BENCH_PS_STEPS=str(steps),
            BENCH_PS_SHARED="1" if shared_memory else "0",
        )
        lines: list[str] = []
        result = launch(
            [sys.executable, __file__, "--train-task"],
            workers=workers,
            ps=1,
            env=env,
            sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
            timeout=900,
        )
        if not result.ok:
            raise RuntimeError(result.explain() + "\n" + "\n".join(lines[-30:]))
        return json.loads(out.read_text())


def train_rounds(args: argparse.Namespace) -> dict:
    """Each round: plain PyTorch (2 threads, then 1), then every parameter-server configuration."""
    configs = [
        (f"parameter server, {w} worker(s), 1 ps, {'shared memory' if shm else 'gRPC'}", w, shm)
        for w in (1, 2)
        for shm in (True, False)
    ]
    names = [f"plain PyTorch, one process, {torch.get_num_threads()} threads", "plain PyTorch, one process, 1 thread"]
    out: dict = {name: {"samples_per_s": [], "ratios": []} for name in [*names, *(c[0] for c in configs)]}
    for _ in range(args.rounds):
        plain = plain_samples_per_s(args.warmup, args.steps)
        figures = {names[0]: plain, names[1]: plain_samples_per_s(args.warmup, args.steps, threads=1)}
        for name, workers, shm in configs:
            figures[name] = training(workers, args.warmup, args.steps, shared_memory=shm)["samples_per_s"]
        for name, value in figures.items():
            out[name]["samples_per_s"].append(value)
            out[name]["ratios"].append(value / plain)
        print(", ".join(f"{name}: {value:.0f}" for name, value in figures.items()), file=sys.stderr)
    return out


def main() -> int:
    if "--train-task" in sys.argv:
        _train_task()
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="training rounds (each: plain, then every configuration)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/parameter_server.json"))
    args = parser.parse_args()
    results: dict = {"transport": transport(args.repeats)}
    lines = [
        (
            "| model | pull+push, same host (shared memory) | ratio (goal >= 0.8) | pull+push over gRPC "
            "(shared_memory=False) | ratio | bare gRPC echo | bare source+sink / echo |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["transport"].items():
        lines.append(
            f"| {name} | {r['ps_bytes_per_s'] / 2**20:.0f} MiB/s ({r['ps_s'] * 1e3:.1f} ms) | "
            f"{r['ratio']:.3f} | {r['grpc_bytes_per_s'] / 2**20:.0f} MiB/s ({r['grpc_s'] * 1e3:.1f} ms) | "
            f"{r['grpc_ratio']:.3f} | {r['echo_bytes_per_s'] / 2**20:.0f} MiB/s ({r['echo_s'] * 1e3:.1f} ms) | "
            f"{r['bare_ratio']:.3f} ({r['bare_s'] * 1e3:.1f} ms) |"
        )
    if not args.skip_training:
        results["training"] = train_rounds(args)
        lines += [
            "",
            ("| MLP training (median of rounds) | samples/s | vs plain PyTorch (default threads), each round |"),
            "|---|---|---|",
        ]
        for name, r in results["training"].items():
            lines.append(
                f"| {name} | {statistics.median(r['samples_per_s']):.0f} | "
                f"{statistics.median(r['ratios']):.3f} ({', '.join(f'{x:.3f}' for x in r['ratios'])}) |"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
