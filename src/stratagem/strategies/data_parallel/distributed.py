"""The model and optimizer that `Strategy.distribute` hands back.

They stand for one replica's model and optimizer: inside `Strategy.run` the replica whose
thread is running, outside it replica 0. So a training step written for one device (calling
`model(x)`, `model.parameters()`, `optimizer.step()`) runs unchanged on every replica.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies import lr_schedulers
from stratagem.strategies.data_parallel import outside_changes
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.replica_context import ReplicaMeeting, current_replica_context

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy


def distributing_strategy(model: DistributedModel) -> Strategy:
    """The strategy whose `distribute` made `model` (not an attribute: it would hide one of the user's model)."""
    return model._host.strategy


def _replica_index(host: ReplicaMeeting) -> int:
    """The running replica of `host`, replica 0 outside its run."""
    replica = host.current_replica()
    return 0 if replica is None else replica


class DistributedModel(nn.Module):
    """One model replica per device, kept identical; calls go to the running replica's copy.

    Example:
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(...))
        >>> model(x)            # inside strategy.run: this replica's copy, on this replica's device
        >>> model.state_dict()  # outside: replica 0's (every replica holds the same values)
    """

    _host: ReplicaHost

    def __init__(self, replicas: Sequence[nn.Module], host: ReplicaHost) -> None:
        super().__init__()
        # Not registered as sub-modules: parameters() must list one replica's parameters, not all of them.
        object.__setattr__(self, "_replicas", list(replicas))
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "training", replicas[0].training)  # the user's mode, not nn.Module's default

    @property
    def module(self) -> nn.Module:
        """The running replica's model (replica 0's outside `Strategy.run`)."""
        return self._replicas[_replica_index(self._host)]

    @property
    def replicas(self) -> list[nn.Module]:
        """Every replica's model, in replica order."""
        return list(self._replicas)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Through the host: a replica whose slice is empty calls the model on a stand-in (empty_slices.py).
        return self._host.call_replica(self.module, args, kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(*args, **kwargs)

    def children(self) -> Iterator[nn.Module]:
        return self.module.children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_children()

    def modules(self, *args: Any, **kwargs: Any) -> Iterator[nn.Module]:
        # Every argument passed on: torch 2.13's Module.modules takes remove_duplicate.
        return self.module.modules(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # passes on every overload of torch's
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = None
        for replica in self._replicas:
            result = replica.load_state_dict(state_dict, strict=strict, assign=assign)
        return result

    def train(self, mode: bool = True) -> "DistributedModel":
        for replica in self._replicas:
            replica.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def to(self, *args: Any, **kwargs: Any) -> "DistributedModel":
        # A script's `model.to(device)` after distribute, naming where the replicas already are, changes nothing.
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [t for r in self._replicas for t in (*r.parameters(), *r.buffers())]
        if all(
            (device is None or t.device == device) and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        raise InputError(
            "A distributed model stays on the devices its strategy chose; it cannot be moved with .to(). "
            f"Received: .to({', '.join(map(repr, args))}). Choose devices with the strategy's `devices=` instead."
        )

    # ---- changes made outside a run: to the module, which every other replica follows (outside_changes.py) ----
    def __setattr__(self, name: str, value: Any) -> None:
        # On one device `model.use_aux = False` reaches the forward; set on this wrapper it would reach none.
        module = self.module
        outside_changes.refuse_new_parameters(module, name, value)
        setattr(module, name, value)
        if name == "training":
            object.__setattr__(self, "training", value)

    def __delattr__(self, name: str) -> None:
        delattr(self.module, name)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self.module.register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        module = self.module
        outside_changes.refuse_new_parameters(module, name, param)
        module.register_parameter(name, param)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        outside_changes.refuse_new_parameters(self.module, name, module)
        self.module.add_module(name, module)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        self.add_module(name, module)

    def apply(self, fn: Callable[[nn.Module], None]) -> DistributedModel:  # type: ignore[override]
        # The module and its submodules, as on one device (nn.Module.apply would also call fn on this wrapper);
        # the values it writes reach the other replicas before the next step.
        self.module.apply(fn)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedModel:
        # .double(), .half(), .cuda(), .cpu(): a no-op where every tensor already is what fn makes of it.
        tensors = [t for t in (*self.module.parameters(), *self.module.buffers())]
        if all(_unchanged_by(fn, t) for t in tensors):
            return self
        raise InputError(
            "A distributed model keeps the dtype and devices it was distributed with: its replicas, optimizer and "
            "gradient combination were built for them. Received: a conversion (.double(), .half(), .cuda(), ...) "
            "that changes the parameters or buffers after distribute(). Convert the model before "
            "strategy.distribute(), and choose devices with the strategy's `devices=`."
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("_replicas", "_host"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __getitem__(self, index: Any) -> Any:
        # Looked up on the class, so __getattr__ never sees it: `model[0]` of an nn.Sequential works as on one device.
        return self.module[index]  # type: ignore[index]

    # ---- pickling: the plain module's own pickle ----------------------------------------------------------
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        # The module's class, as `isinstance(model, GPT2LMHeadModel)` expects on one device, and what pickle writes:
        # pickle emits NEWOBJ for the module's own reduction only where `obj.__class__` is that class, so the pickle
        # of a distributed model is the plain module's own pickle (its globals only: `torch.load(weights_only=True)`
        # with the user's allow-list loads it). `type(model)` stays DistributedModel.
        if "_replicas" not in self.__dict__:
            return type(self)  # inside nn.Module.__init__, before the replicas are set
        return type(self.module)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        # torch.save(model), pickle.dumps(model) and copy.deepcopy(model) give what they give on one device: the
        # plain model (the module, which outside a run holds every replica's values), never the replicas' threads.
        return self.module.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"DistributedModel(num_replicas={len(self._replicas)}, module={self._replicas[0]!r})"


class ReplicatedOptimizer(torch.optim.Optimizer):
    """What the optimizers `distribute` returns share: one optimizer per replica in `_optimizers`, and
    the hyper-parameters in one place, the primary groups (those of the optimizer given to `distribute`).

    Outside `Strategy.run`, `param_groups` are the primary groups, so a user or an LR scheduler that sets
    `lr` there sets it for every replica: each replica's groups are refreshed from them before its step.
    Inside `run` they are views of the running replica's groups that refuse writes: an LR scheduler
    stepped there must be handed to `strategy.distribute_scheduler` (see `lr_schedulers`).
    """

    # Set by each subclass's __init__ (Optimizer.__init__ is not called: this object owns no parameters).
    _optimizers: list[torch.optim.Optimizer]
    _host: ReplicaMeeting
    _watch: lr_schedulers.HyperparameterWatch
    _stepped: bool

    def _start_watch(self) -> None:
        self._watch = lr_schedulers.HyperparameterWatch(lambda: self._primary().param_groups)
        self._stepped = False

    @property
    def primary_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose groups hold the hyper-parameters: the one given to `distribute`."""
        return self._primary()

    @property
    def has_stepped(self) -> bool:
        """Whether `step()` has run at least once."""
        return self._stepped

    def begin_run(self) -> None:
        """A run starts: the hyper-parameters from here on change only through a handed-over scheduler."""
        self._watch.begin_run()

    def end_run(self) -> None:
        """A run ended: refuses a hyper-parameter change that no handed-over scheduler made (`lr_schedulers`)."""
        self._watch.end_run()

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._primary().defaults

    @property
    def replica_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that update the replicas (one per replica, one per replica's share of the
        parameters, or the user's one), in replica order."""
        return list(self._optimizers)

    def _primary(self) -> torch.optim.Optimizer:
        """The optimizer whose groups hold the hyper-parameters (the user's own)."""
        return self._optimizers[0]

    def _replica_optimizer(self, replica: int) -> torch.optim.Optimizer:
        return self._optimizers[replica]

    def _current_replica(self) -> int | None:
        return self._host.current_replica()

    def _meet(self, replica: int, what: str) -> None:
        self._host.meet(replica, what)

    def updated_parameter_indices(self) -> list[int]:
        """Which of a replica's trainable parameters (`ReplicaHost.replica_params[r]`, in the order of
        `model.parameters()`) this optimizer updates, in the order of its groups (a loss scaler's view)."""
        raise NotImplementedError(f"{type(self).__name__} does not say which parameters it updates.")

    @property
    def param_groups(self) -> list[Any]:  # type: ignore[override]
        replica = self._current_replica()
        if replica is None or lr_schedulers.executing():
            return self._primary().param_groups
        return self._watch.view(self._replica_optimizer(replica).param_groups, replica)

    def _sync_hyperparameters(self, replica: int) -> torch.optim.Optimizer:
        """Replica `replica`'s optimizer, with the primary groups' hyper-parameters (an LR scheduler writes those)."""
        self._stepped = True
        optimizer = self._replica_optimizer(replica)
        _copy_hyperparameters(self._primary().param_groups, optimizer.param_groups)
        return optimizer

    @property
    def meeting(self) -> ReplicaMeeting:
        """The replicas' host, as the schedulers handed over for this optimizer see it (`lr_schedulers`)."""
        return self._host

    def publish_hyperparameters(self) -> None:
        """Copies the primary groups' hyper-parameters to every replica's optimizer (after a scheduler step)."""
        for r in range(len(self._optimizers)):
            _copy_hyperparameters(self._primary().param_groups, self._replica_optimizer(r).param_groups)
        self._watch.accept()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InputError(
            "Parameter groups cannot be added to an optimizer after it was distributed. "
            f"Received: a group with keys {sorted(param_group)}. Add every group before strategy.distribute()."
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas={len(self._optimizers)}, optimizer={self._optimizers[0]!r})"


def positions(params: Sequence[nn.Parameter], groups: Sequence[dict[str, Any]]) -> list[int]:
    """The position in `params` of each parameter of `groups`, in the groups' order (a frozen parameter is not
    in `params`: it has no gradient)."""
    position = {id(p): i for i, p in enumerate(params)}
    return [position[id(p)] for group in groups for p in group["params"] if id(p) in position]


KERNEL_KEYS = ("fused", "foreach")
"""Group entries that choose kernels, not arithmetic: a replica's optimizer may keep its own."""


def _copy_hyperparameters(source: Sequence[dict[str, Any]], target: Sequence[dict[str, Any]]) -> None:
    for primary, mine in zip(source, target):
        if primary is mine:
            continue
        for key, value in primary.items():
            if key != "params" and key not in KERNEL_KEYS:
                mine[key] = value


class DistributedOptimizer(ReplicatedOptimizer):
    """One optimizer per replica, each updating its own replica's parameters identically.

    Replica 0's optimizer is the one given to `distribute`; the others are copies of it with
    their own state tensors. Hyper-parameters set on it (an LR scheduler writing
    `param_groups[i]["lr"]`) are copied to the other replicas before each of their steps.
    """

    _host: ReplicaHost

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], host: ReplicaHost) -> None:
        # torch.optim.Optimizer.__init__ is not called: this object owns no parameters of its own.
        self._optimizers = list(optimizers)
        self._host = host
        self._start_watch()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The running replica's optimizer (replica 0's outside `Strategy.run`)."""
        return self._optimizers[_replica_index(self._host)]

    def updated_parameter_indices(self) -> list[int]:
        return positions(self._host.replica_params[0], self._optimizers[0].param_groups)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if current_replica_context() is None:
            raise InputError(
                "optimizer.step() ran outside strategy.run(), so only replica 0 would be updated and the replicas "
                "would drift apart. Call it in the function given to strategy.run()."
            )
        optimizer = self._sync_hyperparameters(_replica_index(self._host))
        return traced_step(self._host, lambda: optimizer.step(closure))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch keeps a loaded tensor that already has the parameter's dtype and device, so one dict loaded
        # into every replica would leave them sharing state tensors (each replica's step updating all of
        # them): replica 0 takes the dict as a plain optimizer would, every other replica a copy of its own.
        self._optimizers[0].load_state_dict(state_dict)
        for optimizer in self._optimizers[1:]:
            optimizer.load_state_dict(_private_copy(state_dict))


def _private_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with every state tensor cloned (the structure copied, other values kept)."""
    state = {
        key: {
            name: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for name, value in entry.items()
        }
        for key, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": state, "param_groups": copy.deepcopy(state_dict["param_groups"])}


def clone_optimizer(
    optimizer: torch.optim.Optimizer, mapping: Mapping[int, torch.Tensor], *, with_state: bool = True
) -> torch.optim.Optimizer:
    """A copy of `optimizer` over other parameters: `mapping` takes the id of each parameter it holds to
    the parameter the copy holds instead. Every state tensor of the copy is its own (with_state=False:
    the copy starts with no state).

    Made by `copy.deepcopy`, that is by the class's own copy protocol (`__reduce_ex__`, `__getstate__`,
    `__setstate__`), never by its `__init__`, whose signature is the class's own business (torch's AdamW
    does not take every key of its own `defaults`; a user's subclass may take other arguments altogether).
    The memo makes every reference to a source parameter (group lists, state keys, LBFGS's `_params`) one
    to the replica's parameter, and every tensor of the state a new one, so no two replicas ever share a
    state tensor. torch's `Optimizer.__getstate__` carries only `defaults`, `state` and `param_groups`
    (it is written for the base class), so for a class that keeps torch's the attributes its `__init__`
    set beside those (LBFGS's `_params`, a subclass's own fields, the user's hooks) are deep-copied onto
    the copy with the same memo; a class with a `__getstate__` of its own says itself what a copy holds.
    """
    memo: dict[int, Any] = dict(mapping)
    memo[id(memo)] = [optimizer]  # keeps what the memo refers to alive, as deepcopy does with its own entries
    if not with_state:
        memo[id(optimizer.state)] = defaultdict(dict)
    clone = copy.deepcopy(optimizer, memo)
    if type(optimizer).__getstate__ is torch.optim.Optimizer.__getstate__:
        carried = set(optimizer.__getstate__())
        for name, value in vars(optimizer).items():
            if name in carried or _set_by_a_scheduler(name, value):
                continue
            setattr(clone, name, copy.deepcopy(value, memo))
    if clone.state and any(p.device != src_device for p, src_device in _moved(optimizer, clone)):
        clone.load_state_dict(clone.state_dict())  # moves the copied state next to the replica's parameters
    return clone


def _set_by_a_scheduler(name: str, value: Any) -> bool:
    """Whether an optimizer's attribute is what torch's LR scheduler set on it: its wrapper of `step` (which
    calls the source optimizer, never the copy) or the flag that wrapper raises."""
    return name == "_opt_called" or (name == "step" and hasattr(value, "_wrapped_by_lr_sched"))


def _moved(source: torch.optim.Optimizer, clone: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, torch.device]]:
    for mine, theirs in zip(clone.param_groups, source.param_groups):
        for p, q in zip(mine["params"], theirs["params"]):
            yield p, q.device


def replicate_optimizer(
    optimizer: torch.optim.Optimizer, source_params: Sequence[nn.Parameter], params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """A copy of `optimizer` (same class, hyper-parameters and state, its own state tensors) over `params`,
    the replica's parameters in the order of `source_params`."""
    return clone_optimizer(optimizer, {id(src): dst for src, dst in zip(source_params, params)})


def _unchanged_by(fn: Any, tensor: torch.Tensor) -> bool:
    """Whether `fn` (a conversion nn.Module._apply would apply) leaves `tensor` as it is."""
    try:
        return fn(tensor) is tensor
    except (RuntimeError, AssertionError, TypeError):  # e.g. .cuda() on a CPU-only build: it would change it
        return False


def check_optimizer_supported(optimizer: torch.optim.Optimizer | None, num_replicas: int, strategy: str) -> None:
    """Raises `InputError` for an optimizer whose update cannot be the one-device update across replicas."""
    if num_replicas > 1 and isinstance(optimizer, torch.optim.LBFGS):
        raise InputError(
            f"{strategy} cannot train with LBFGS over {num_replicas} replicas: LBFGS re-evaluates the loss through "
            "its closure several times per step and decides its line search and stopping from the loss value, "
            "which each replica knows only for its own slice of the batch, so the replicas would take other "
            f"steps than one device. Received: {type(optimizer).__name__} with {num_replicas} replicas in sync. "
            "Train with LBFGS on one device (OneDeviceStrategy), or choose a first-order optimizer (SGD, Adam, ...)."
        )


def traced_step(host: ReplicaMeeting, step: Callable[[], Any]) -> Any:
    """`step()`, recorded as the optimizer step of the running replica when its host traces."""
    recorder = host.recorder
    if recorder is None or not recorder.on:
        return step()
    start = recorder.now()
    try:
        return step()
    finally:
        recorder.span("optimizer", "optimizer step", start, recorder.now())
