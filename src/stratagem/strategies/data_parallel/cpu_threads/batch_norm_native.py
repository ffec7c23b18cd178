"""Exact BatchNorm's layer calls and meetings in C++ (batch_norm_native.cpp), where the replicas are threads
of one process on a CPU.

Why: with the meetings in Python, two replica threads in lockstep at every BatchNorm layer take turns under
Python's global lock at each meeting (they reach Python at the same moments after it), and each layer call
runs about 190 us of Python (the autograd function, its forward and backward, the per-channel arithmetic).
On ResNet-18 under Mirrored x2 on this project's 2-core machine that made exact BatchNorm 1.22-1.30x the
step of per-replica statistics; with the layer call in C++ (one call that releases the lock for its whole
length, and a backward that never takes it) it is within a few percent (benchmarks/batch_norm.py, reports in
benchmarks/reports/). The arithmetic is the Python path's, operation for operation, so the two give the
same bits (`tests/test_batch_norm_native.py`).

It is an opt-in speed-up, built ahead of time and never inside `distribute`: `stratagem native build` compiles
it once per machine with torch's own extension builder (a C++ compiler and ninja, from the `native` extra:
`pip install 'stratagem[native]'`), about 30 s on 2 cores, into torch's extension cache (`TORCH_EXTENSIONS_DIR`,
by default ~/.cache/torch_extensions). `distribute` only loads a library that is already built (a fraction of a
second); where there is none, or with STRATAGEM_NATIVE_BATCH_NORM=0, the layers run the Python meetings, which
train the same model. `explain()` and `stratagem doctor` say which path runs and how to get the other.

What stays in Python is what is rare: the errors of a meeting that goes wrong (the same checks and messages
as `ReplicaBarrier`'s, asked when a wait passes a poll interval or a replica arrives where it should not), a
replica's combination weight (once a step), and the sums across workers (MultiWorkerMirroredStrategy), which
the last replica to arrive hands to Python.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from stratagem import environ
from stratagem.errors import InputError
from stratagem.strategies.data_parallel.batch_norm_function import StatisticsMeeting, check_size, refuse_zero_weight
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier
from stratagem.strategies.replica_context import current_replica_context


class NativeSync(StatisticsMeeting, Protocol):
    """What a native meeting asks of the `batch_norm.BatchNormSync` it serves: a `StatisticsMeeting` that says
    whether it also sums across workers (declared here: batch_norm.py imports this module)."""

    @property
    def sums_across_workers(self) -> bool:
        """Whether the last replica to arrive at a meeting also sums across workers."""


logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("batch_norm_native.cpp")
SWITCH = environ.NATIVE_BATCH_NORM
# No contraction of a * b + c into a fused multiply-add the source does not ask for (the same roundings as NumPy's).
# Where torch runs its AVX2 or AVX-512 kernels (which fuse them), the input gradient takes one pass instead of two
# with the same roundings (batch_norm_native.cpp, `input_gradient`), its std::fma one instruction.
FUSED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
FLAGS = ("-O3", "-ffp-contract=off", *(("-mfma", "-DSTRATAGEM_FUSED_INPUT_GRADIENT") if FUSED else ()))
BUILD_WAIT = 900.0  # seconds to wait for another process building the same extension
POLL = 0.1  # seconds a native wait runs before Python looks for a replica that failed or went elsewhere
SPIN = 1e-3  # seconds a replica that arrived early watches for the last one before it sleeps (see `spin`)


NOT_BUILT = (
    "it is not built on this machine (an opt-in speed-up: `stratagem native build` builds it once, with a C++ "
    "compiler and `pip install 'stratagem[native]'`)"
)


@dataclass(frozen=True)
class Location:
    """Where the extension of this source, torch, Python and flags is built: its name and folder."""

    name: str
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"


def location(env: Mapping[str, str] | None = None) -> Location:
    """The extension's name (a digest of what it is built from) and folder in torch's extension cache."""
    digest = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), " ".join(FLAGS).encode()])
    ).hexdigest()[:16]
    name = f"stratagem_batch_norm_{digest}"
    return Location(name, environ.torch_extensions_dir(env) / name)


@functools.cache
def extension() -> tuple[ModuleType | None, str]:
    """(the built extension, "") or (None, why it is not used). Loaded once per process; never built here."""
    env = environ.current()
    if environ.native_batch_norm_setting(env) == "0":
        return None, f"{SWITCH}=0 is set"
    where = location(env)
    if not where.library.exists():
        return None, NOT_BUILT
    try:
        return _load(where), ""
    except Exception as exc:  # a library of another build that will not load: the Python meetings, said once
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"its library {where.library} does not load ({type(exc).__name__}: {first[:300]})"
        logger.warning(
            "stratagem: exact BatchNorm runs its meetings in Python: %s. Build it again with `stratagem native "
            "build`, or set STRATAGEM_NATIVE_BATCH_NORM=0 to choose the Python meetings.",
            reason,
        )
        return None, reason


def _load(where: Location) -> ModuleType:
    """The built library imported as a module, as torch's extension loader imports one (no build tool needed)."""
    spec = importlib.util.spec_from_file_location(where.name, where.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module can be made of {where.library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(env: Mapping[str, str] | None = None) -> Path:
    """Builds the extension into torch's extension cache (or finds it built) and returns its library's path.

    The work of `stratagem native build`: it needs a C++ compiler and `ninja` on PATH (the `native` extra installs
    ninja into the environment's bin folder). Raises `InputError` with the fix where either is missing, or where a
    build that was stopped left torch's lock file behind (torch would wait on it for ever).
    """
    from torch.utils import cpp_extension

    where = location(env)
    if where.library.exists():
        return where.library
    if shutil.which("ninja") is None:
        raise InputError(
            "Building exact BatchNorm's native meeting needs ninja on PATH, which it is not. Received: PATH without "
            "ninja. Install it with `pip install 'stratagem[native]'` and run the command from that environment "
            "(activate it, or put its bin folder on PATH)."
        )
    where.directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(where.directory / "stratagem.lock"):
        stale = where.directory / "lock"
        if stale.exists():
            # We hold our own lock, so nobody is building: torch's file is what a stopped build left behind.
            raise InputError(
                f"A build that was stopped left torch's lock file {stale}, on which torch's builder would wait for "
                f"ever. Received: {stale} present while no build runs. Delete it and run `stratagem native build` "
                "again."
            )
        cpp_extension.load(
            name=where.name,
            sources=[str(SOURCE)],
            extra_cflags=list(FLAGS),
            build_directory=str(where.directory),
            verbose=False,
        )
    return where.library


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Holds an advisory lock on `path` (one build at a time across processes), waiting at most BUILD_WAIT."""
    import fcntl  # POSIX: elsewhere the ImportError says so

    with open(path, "a+") as handle:
        deadline = time.monotonic() + BUILD_WAIT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process held {path} for more than {BUILD_WAIT:g} s while building the extension"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def spin(num_local: int) -> float:
    """How long a replica that arrives early at a meeting watches for the last one on its own core before sleeping:
    SPIN while every replica thread has a core of this process's (the watching core would otherwise idle, and a
    wake-up from sleep costs tens of microseconds a meeting), none where replicas share cores (watching would take
    the core from the replica it waits for). Measured in one process on the 2-core machine (alternating blocks,
    exact / per-replica BatchNorm): the CNN 1.070 without, 1.052 with 0.1 ms, 1.041 with 1 ms; ResNet-18 1.062 with
    0.1 ms, 1.042 with 1 ms (benchmarks/reports/2026-12-03-cpu-2vcpu-batch-norm-6.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN if num_local <= cores else 0.0


def takes(module: nn.Module, input: torch.Tensor) -> bool:
    """Whether the native call does this layer's work: a dense CPU tensor of float32 or float64, with the layer's
    parameters and buffers (where it has them) plain tensors of the same dtype, contiguous."""
    if input.layout != torch.strided or input.device.type != "cpu" or input.dim() < 2:
        return False
    if input.dtype not in (torch.float32, torch.float64):
        return False
    for t in (input, module.weight, module.bias, module.running_mean, module.running_var):
        if t is None:
            continue
        if type(t) not in (torch.Tensor, nn.Parameter) or t.device.type != "cpu" or t.dtype != input.dtype:
            return False
        if t is not input and not t.is_contiguous():
            return False
    return True


class NativeMeetings:
    """One `BatchNormSync`'s native meeting and the Python it calls for what is rare."""

    def __init__(self, module: ModuleType, sync: NativeSync, barrier: ReplicaBarrier, num_local: int) -> None:
        self._module = module
        hooks = _Hooks(weakref.ref(sync), barrier)
        self.meeting = module.Meeting(num_local, POLL, spin(num_local), hooks, sync.sums_across_workers)
        self._timing_step: int | None = None

    def begin_step(self, step: int, timed: bool) -> None:
        self.meeting.reset(timed)
        self._timing_step = step if timed else None

    def times(self) -> tuple[int, int, list[int], int] | None:
        """(step, meetings, ns each local replica spent in them, the end of the last) of the timed step, if any."""
        if self._timing_step is None:
            return None
        meetings, spent, last_end = self.meeting.times()
        return (self._timing_step, meetings, spent, last_end) if meetings else None

    def forward(
        self, layer: int, module: nn.Module, input: torch.Tensor, local: int, standing_in: bool, factor: float
    ) -> torch.Tensor:
        """The layer's output; `local`: the replica's index among this process's replicas."""
        training = module.training
        out: torch.Tensor = self._module.global_batch_norm(
            self.meeting,
            input,
            module.weight,
            module.bias,
            module.running_mean if training else None,
            module.running_var if training else None,
            local,
            2 * layer,
            standing_in,
            factor,
            module.eps,
        )
        return out


class _Hooks:
    """What the native meeting asks of Python. Holds its `BatchNormSync` weakly: the meeting is the sync's."""

    def __init__(self, sync: weakref.ref[NativeSync], barrier: ReplicaBarrier) -> None:
        self._sync = sync
        self._barrier = barrier

    def _get(self) -> NativeSync:
        sync = self._sync()
        if sync is None:
            raise RuntimeError(
                "The strategy of this BatchNorm layer is gone: its graph was kept past the strategy. Call backward() "
                "inside strategy.run()."
            )
        return sync

    def what(self, tag: int) -> str:
        layer, backward = divmod(tag, 2)
        return f"BatchNorm statistics of '{self._get().layer_name(layer)}' ({'backward' if backward else 'forward'})"

    def check(
        self, replica: int, tag: int, other: int, arrived: list[int], twice: bool, failed: bool, waited: float
    ) -> None:
        sync = self._get()
        what = self.what(tag)
        self._barrier.check_elsewhere(
            replica,
            what,
            sync.step_number(),
            arrived,
            their_what=self.what(other) if other != tag else None,
            twice=twice,
            failed=failed,
            waited=waited,
        )

    def share(self, local: int, tag: int, has_examples: bool, batch: int) -> float:
        sync = self._get()
        replica = _replica_id(local)
        combination = sync.weight_of(replica)
        if combination == 0 and has_examples:
            refuse_zero_weight(sync, tag // 2, replica, batch)
        return combination or 0.0

    def too_small(self, local: int, tag: int, size: float, shape: tuple[int, ...]) -> None:
        name = self._get().layer_name(tag // 2)
        check_size(size, f"BatchNorm layer '{name}' (input of shape {shape} on replica {_replica_id(local)})")

    def across(self, total: torch.Tensor, tag: int) -> None:
        sync = self._get()
        try:
            sync.sum_across_workers(total, self.what(tag), sync.step_number())
        except BaseException as error:
            self._barrier.abort(error)  # the local replicas waiting for this sum fail with its cause
            raise


def _replica_id(local: int) -> int:
    """The replica id in the sync group of the replica running this hook (its thread's context; a hook runs on the
    replica's own thread): the meeting counts replicas by local index, which for one replica a process is 0."""
    ctx = current_replica_context()
    return ctx.replica_id_in_sync_group if ctx is not None else local


def describe(native: NativeMeetings | None, reason: str) -> str:
    """Where the meetings run, for `explain()`."""
    if native is not None:
        return "in C++ (batch_norm_native.cpp): each layer call releases Python's global lock for its whole length"
    return f"in Python, {reason}: the same results, slower between CPU replica threads of one process"
