"""A second device for placement tests on a CPU-only machine: `sgdev`, a Python backend.

Soft placement and cross-device copies need a device other than the CPU that holds real data
and has its own kernel table. `meta` has no data (nothing can be copied to the CPU) and the
`lazy` device falls back to the CPU for every operation by itself, so neither can show an
operation with no kernel. torch's PrivateUse1 dispatch key can be given a backend written in
Python (torch.utils.backend_registration): here each `sgdev` tensor keeps its values in a CPU
tensor, and the backend has kernels for the short, explicit list of aten operations below and
nothing else. An operation registered for the CPU only (the test ops at the bottom) therefore
really has no kernel on `sgdev`, and torch says so ("Could not run ... from the 'sgdev'
backend"), exactly as it does for a CPU-only op on a CUDA tensor. torch also runs `sgdev`
backward passes on an autograd device thread, as it does for CUDA, so the tests see that path.

The backend is registered once per process (torch allows one PrivateUse1 backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

DEVICE = "sgdev"

# The aten operations sgdev has kernels for; anything else has none on sgdev.
_DELEGATED = [
    "empty.memory_format",
    "empty_strided",
    "zeros_like",
    "ones_like",
    "fill_.Scalar",
    "zero_",
    "add.Tensor",
    "add_.Tensor",
    "sub.Tensor",
    "mul.Tensor",
    "mul_.Tensor",
    "div.Tensor",
    "neg",
    "pow.Tensor_Scalar",
    "sum",
    "sum.dim_IntList",
    "mean",
    "mm",
    "t",
    "view",
    "expand",
    "detach",
    "clone",
    "alias",
    "_local_scalar_dense",
]


class SgdevTensor(torch.Tensor):
    """A tensor on `sgdev`; its values live in `self.raw`, a CPU tensor."""

    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor) -> Self:
        tensor = torch._C._acc.create_empty_tensor(list(raw.shape), raw.dtype)
        tensor.__class__ = cls
        return tensor

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw

    __torch_function__ = torch._C._disabled_torch_function_impl


def _to_raw(value: Any) -> Any:
    if isinstance(value, SgdevTensor):
        return value.raw
    if isinstance(value, torch.device) and value.type == DEVICE:
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith(DEVICE):
        return "cpu"
    return value


def _kernel(name: str):
    packet_name, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        by_raw = {id(v.raw): v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, SgdevTensor)}
        raw_args, raw_kwargs = pytree.tree_map(_to_raw, (args, kwargs))
        out = op(*raw_args, **raw_kwargs)
        # An in-place kernel returns its (mutated) input: give back the same sgdev tensor.
        return pytree.tree_map(lambda v: _wrap(v, by_raw), out)

    return kernel


def _wrap(value: Any, by_raw: dict[int, SgdevTensor]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    same = by_raw.get(id(value))
    return same if same is not None else SgdevTensor(value)


def _to_copy(
    x: torch.Tensor, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None
) -> torch.Tensor:
    source = x.raw if isinstance(x, SgdevTensor) else x
    out = torch.ops.aten._to_copy.default(source, dtype=dtype, device=torch.device("cpu"))
    target = torch.device(device) if device is not None else x.device
    return SgdevTensor(out) if target.type == DEVICE else out


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    target = dst.raw if isinstance(dst, SgdevTensor) else dst
    target.copy_(src.raw if isinstance(src, SgdevTensor) else src)
    return dst


_library: torch.library.Library | None = None


def setup() -> str:
    """Registers the `sgdev` backend (once per process); returns the device name."""
    global _library
    if _library is not None:
        return DEVICE
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        raise RuntimeError(f"PrivateUse1 is already the {current!r} backend in this process; sgdev cannot register.")
    torch.utils.backend_registration._setup_privateuseone_for_python_backend(DEVICE)
    library = torch.library.Library("aten", "IMPL")
    for name in _DELEGATED:
        library.impl(name, _kernel(name), "PrivateUse1")
    library.impl("_to_copy", _to_copy, "PrivateUse1")
    library.impl("copy_", _copy_, "PrivateUse1")
    _library = library
    return DEVICE


# ---- operations registered for the CPU only -------------------------------------------------

_ops: dict[str, Any] = {}


def cpu_only_ops() -> dict[str, Any]:
    """Custom operations with a CPU kernel and no other: `cube` (with an autograd formula whose
    backward calls `square`, itself CPU-only), `square`, and `scale_` (mutates its input)."""
    if _ops:
        return _ops

    @torch.library.custom_op("sgtest::square", mutates_args=(), device_types="cpu")
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @torch.library.custom_op("sgtest::cube", mutates_args=(), device_types="cpu")
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * square(x)  # d(x^3)/dx, through another CPU-only op

    cube.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op("sgtest::scale_", mutates_args=("x",), device_types="cpu")
    def scale_(x: torch.Tensor, factor: float) -> None:
        x.mul_(factor)

    _ops.update(square=square, cube=cube, scale_=scale_)
    return _ops


# ---- running cases on sgdev in a fresh process --------------------------------------------------
# torch sizes its autograd device threads at the first backward pass of a process, so sgdev must be
# registered before any training: its cases run together in one spawned process, once per test
# session, and each test reads its case's result. A case returns plain, picklable data.

_cases: dict[str, tuple[str, str]] = {}
_results: dict[str, tuple[bool, Any]] | None = None


def register(*cases: Any) -> None:
    """Registers module-level functions to run on sgdev (call it at import, from the test module)."""
    for case in cases:
        _cases[f"{case.__module__}.{case.__name__}"] = (case.__module__, case.__name__)


def _run_cases(rank: int, cases: list[tuple[str, str]]) -> bytes:
    import importlib
    import pickle
    import traceback

    setup()  # first thing in the process, before any backward pass
    results: dict[str, tuple[bool, Any]] = {}
    for module, name in cases:
        try:
            results[f"{module}.{name}"] = (True, getattr(importlib.import_module(module), name)())
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            results[f"{module}.{name}"] = (False, traceback.format_exc())
    # Pickled here, by value: the queue's pickler would share tensors through file descriptors
    # that vanish with this process before the parent reads them.
    return pickle.dumps(results)


def result(case: Any) -> Any:
    """What `case` returned in the sgdev process (every registered case runs on the first call)."""
    global _results
    if _results is None:
        import pickle

        from helpers import run_ranks

        outcome = run_ranks(_run_cases, [0], args=(sorted(_cases.values()),), timeout=150)[0]
        if outcome.error is not None:
            raise AssertionError(f"the sgdev process failed: {outcome.error_type}: {outcome.error}")
        _results = pickle.loads(outcome.value)
    ok, value = _results[f"{case.__module__}.{case.__name__}"]
    if not ok:
        raise AssertionError(f"{case.__name__} failed in the sgdev process:\n{value}")
    return value
