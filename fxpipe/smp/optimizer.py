"""``DistributedOptimizer``: the user's own optimizer, moved onto this rank's stage at partitioning.

Note [optimizer in place]: in the seed's scripts the optimizer is built over
``model.parameters()`` *before* the first step partitions the model. Rather than
returning a new object (which LR schedulers and GradScalers built over the old one
would not see), ``DistributedOptimizer(opt)`` returns ``opt`` itself, with its class
untouched (``type(opt)`` is still ``torch.optim.SGD``). What fxpipe keeps for it (the
original key of every parameter per group, a partial state loaded before
partitioning, the ZeRO shard) is a ``WrappedOptimizer`` in the API state's
``OptimizerRegistry``, not attributes on the user's object. Right after partitioning
each param group's ``params`` is replaced by the stage's parameters with the same
original keys, and the group's options (lr, momentum, ...) and any state are kept.

The seed API's methods must work on that very object, and torch's optimizer hooks
cannot give them: a step hook cannot replace the step by the ZeRO optimizer's, a
``load_state_dict`` pre-hook cannot put a partial state aside until partitioning, and
there is no ``local_state_dict``. So ``step``, ``state_dict``, ``local_state_dict`` and
``load_state_dict`` are bound on the instance (as torch's LR schedulers bind
``optimizer.step``); each looks its ``WrappedOptimizer`` up in the registry, and
``fxpipe.shutdown()`` removes them again.

State dicts: ``local_state_dict()`` is torch's own plus the seed's ``_smp_is_partial``
marker and ``param_names`` (the original key of each local parameter, per group);
``state_dict()`` gathers every stage's and renumbers them as the one-process
optimizer over the whole model would, so a full checkpoint loads in either world.

Note [sharded optimizer state]: with ``shard_optimizer_state: True`` and several
data-parallel replicas, localizing also builds a
``torch.distributed.optim.ZeroRedundancyOptimizer`` over the same param groups (the
same class and options) on the data-parallel group. The user's object stays the one
everybody holds (schedulers, GradScaler): its param groups still list every local
parameter, ``step()`` copies their options (lr...) into the ZeRO optimizer and steps
that, which updates this replica's share and broadcasts it, and its own ``state``
stays empty (the shard lives in ZeRO). ``local_state_dict()`` all-gathers the shards
over the data-parallel group, so it and ``state_dict()`` return the unsharded format
and are collective over the data-parallel group (call them on every rank, save on
``dp_rank() == 0``); ``load_state_dict`` gives each replica its share.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel.state_dict import gather_if_sharded, shard_optimizer_state
from fxpipe.smp.driver import StepError
from fxpipe.smp.state import PARTIAL_KEY, current, is_initialized

__all__ = ["DistributedOptimizer", "WrappedOptimizer", "sharded_optimizer"]

_NAMES = "param_names"
_SEED_METHODS = ("step", "state_dict", "local_state_dict", "load_state_dict")


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _constructor_defaults(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``defaults`` that ``cls(params, ...)`` accepts (AdamW's defaults hold a key its constructor lacks)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def DistributedOptimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:  # noqa: N802 - the seed's name
    """Make ``optimizer`` pipeline-aware (see Note [optimizer in place]); returns the same object.

    Example::

        optimizer = fxpipe.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    st = current()
    if st.optimizers.get(optimizer) is not None:
        return optimizer
    wrapped = WrappedOptimizer(optimizer)
    st.optimizers.add(wrapped)
    wrapped.install()
    if st.model is not None and st.model.partitioned:
        wrapped.localize(st.model)
    return optimizer


def sharded_optimizer(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer | None:
    """The ZeRO optimizer that holds ``optimizer``'s state shard (Note [sharded optimizer state]), if any."""
    wrapped = current().optimizers.get(optimizer)
    return wrapped.zero if wrapped is not None else None


def _seed_method(name: str) -> Callable[..., Any]:
    """``optimizer.<name>(...)`` -> the same method of its ``WrappedOptimizer``, bound on the optimizer so
    that an LR scheduler's re-binding of ``optimizer.step`` (``step.__func__.__get__(optimizer)``) still works."""

    def method(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        wrapped = current().optimizers.get(optimizer) if is_initialized() else None
        if wrapped is not None:
            return getattr(wrapped, name)(*args, **kwargs)
        if hasattr(
            type(optimizer), name
        ):  # after shutdown (through an LR scheduler's wrapper): plain torch
            return getattr(type(optimizer), name)(optimizer, *args, **kwargs)
        raise ConfigError(
            f"optimizer.{name}() of a DistributedOptimizer after fxpipe.shutdown(): wrap the "
            "optimizer again after fxpipe.init"
        )

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(WrappedOptimizer, name).__doc__
    return method


class WrappedOptimizer:
    """fxpipe's bookkeeping for one optimizer given to ``DistributedOptimizer``, and the seed's methods.

    ``keys``: the original key of every parameter, per group (``None`` until partitioning);
    ``local_names``: those of this stage's parameters; ``pending``: a partial state dict
    loaded before partitioning; ``zero``: the ZeRO optimizer holding the state shard.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.keys: list[list[str]] | None = None
        self.local_names: list[list[str]] = []
        self.pending: dict[str, Any] | None = None
        self.zero: ZeroRedundancyOptimizer | None = None
        self._own_step = optimizer.__dict__.get(
            "step"
        )  # an LR scheduler's step wrapper made before us, if any

    def install(self) -> None:
        """Bind the seed's methods on the optimizer object (see Note [optimizer in place])."""
        for name in _SEED_METHODS:
            setattr(self.optimizer, name, types.MethodType(_SEED_FUNCTIONS[name], self.optimizer))

    def uninstall(self) -> None:
        """Take the seed's methods off the optimizer object again (``fxpipe.shutdown``)."""
        for name in _SEED_METHODS:
            bound = self.optimizer.__dict__.get(name)
            if isinstance(bound, types.MethodType) and bound.__func__ is _SEED_FUNCTIONS[name]:
                delattr(self.optimizer, name)
        if self._own_step is not None and "step" not in self.optimizer.__dict__:
            self.optimizer.step = self._own_step  # type: ignore[method-assign]

    @property
    def localized(self) -> bool:
        return self.keys is not None

    # -- partitioning ----------------------------------------------------------

    def localize(self, model: Any) -> None:
        """Point every param group at this stage's parameters (same original keys)."""
        opt = self.optimizer
        local: dict[str, torch.nn.Parameter] = {}
        for key, p in model.module.named_parameters(remove_duplicate=False):
            local.setdefault(model.primary_key(key), p)
        stage_ids = {id(p): k for k, p in local.items()}
        keys_per_group: list[list[str]] = []
        new_state: dict[torch.Tensor, Any] = {}
        for group in opt.param_groups:
            keys, params = [], []
            for p in group["params"]:
                key = model.original_key(p) or stage_ids.get(id(p))
                if key is None:
                    raise ConfigError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the "
                        "DistributedModel; build the optimizer over model.parameters()"
                    )
                keys.append(key)
                if key in local:
                    params.append(local[key])
                    if p in opt.state:
                        new_state[local[key]] = opt.state[p]
            group["params"] = params
            keys_per_group.append(keys)
        opt.state.clear()
        opt.state.update(new_state)
        self.keys = keys_per_group
        self.local_names = [[k for k in keys if k in local] for keys in keys_per_group]
        dp = model.replicas
        if (
            dp.stage is not None
            and dp.options.shard_optimizer_state
            and any(g["params"] for g in opt.param_groups)
        ):
            self._shard(current().dp_group)
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.load_state_dict(pending)

    def _shard(self, group: Any) -> None:
        """Build the ZeRO optimizer over the local param groups and move any state into it."""
        opt = self.optimizer
        base = type(opt)
        state = base.state_dict(opt) if opt.state else None
        groups = [dict(g) for g in opt.param_groups]
        self.zero = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=base,
            process_group=group,
            **_constructor_defaults(base, opt.defaults),
        )
        if state is not None:
            self._load_local(state)

    def step(self, closure: Any = None) -> Any:
        """The optimizer step (on this replica's shard when sharded); refused inside an accumulation window."""
        st = current()
        if st.model is not None and st.model.partitioned and not st.model.replicas.synced:
            raise StepError(
                f"optimizer.step() was called after {st.model.replicas.stage.passes} of "
                f"backward_passes_per_step={st.model.ddp_options.backward_passes_per_step} steps, before "
                "the gradients were averaged over the replicas; call it (and zero_grad) only every "
                "backward_passes_per_step-th step"
            )
        if self.zero is None:
            if self._own_step is not None:
                return self._own_step(closure)
            return type(self.optimizer).step(self.optimizer, closure)
        for mine, theirs in zip(self.optimizer.param_groups, self.zero.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        return self.zero.step(closure)

    # -- state dicts -----------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's optimizer state (torch's format), marked partial, with each parameter's key."""
        sd = gather_if_sharded(
            type(self.optimizer).state_dict(self.optimizer)
        )  # FSDP shards: whole (collective)
        if self.zero is not None:
            sd["state"] = self._gather_shards()
        if self.localized:
            sd[_NAMES] = [list(names) for names in self.local_names]
        sd[PARTIAL_KEY] = True
        return sd

    def _gather_shards(self) -> dict[int, Any]:
        """Every replica's share of the state, numbered as ``state_dict`` numbers the local parameters (collective)."""
        zero: Any = self.zero
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        mine = {index[id(p)]: _to_cpu(s) for p, s in zero.optim.state.items()}
        parts: list[Any] = [None] * dist.get_world_size(zero.process_group)
        dist.all_gather_object(parts, mine, group=zero.process_group)
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items()))

    def _load_local(self, sd: dict[str, Any]) -> None:
        """Load a torch-format state dict of the local parameters (into the ZeRO shard when sharded)."""
        base = type(self.optimizer)
        if self.zero is None:
            base.load_state_dict(
                self.optimizer, shard_optimizer_state(sd, self.optimizer)
            )  # FSDP: this rank's cut
            return
        # ZeRO looks state up by position among the local parameters: renumber the saved ids 0..n-1
        renumber = {
            old: new for new, old in enumerate(i for g in sd["param_groups"] for i in g["params"])
        }
        groups = [{**g, "params": [renumber[i] for i in g["params"]]} for g in sd["param_groups"]]
        state = {renumber[i]: v for i, v in sd["state"].items() if i in renumber}
        base.load_state_dict(self.optimizer, {"state": {}, "param_groups": groups})  # the options
        self.zero.load_state_dict({"state": state, "param_groups": [dict(g) for g in groups]})

    def state_dict(self) -> dict[str, Any]:
        """The whole model's optimizer state, numbered as a one-process optimizer's (collective)."""
        if not self.localized:
            return type(self.optimizer).state_dict(self.optimizer)
        st = current()
        mine = _to_cpu(self.local_state_dict())
        parts: list[Any] = [None] * st.layout.num_stages
        dist.all_gather_object(parts, mine, group=st.pipeline_group)
        keys = self.keys or []
        index = {k: i for i, k in enumerate(k for group in keys for k in group)}
        state: dict[int, Any] = {}
        for part in parts:
            for names, group in zip(part[_NAMES], part["param_groups"]):
                for name, local_id in zip(names, group["params"]):
                    if local_id in part["state"]:
                        state.setdefault(index[name], part["state"][local_id])
        groups = []
        for own, group_keys in zip(mine["param_groups"], keys):
            groups.append(
                {
                    **{k: v for k, v in own.items() if k != "params"},
                    "params": [index[k] for k in group_keys],
                }
            )
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (``state_dict``) or partial (``local_state_dict``) optimizer state."""
        sd = dict(state_dict)
        partial = bool(sd.pop(PARTIAL_KEY, False))
        names = sd.pop(_NAMES, None)
        if not self.localized:
            if partial:
                self.pending = {**sd, PARTIAL_KEY: True, _NAMES: names}
                return
            type(self.optimizer).load_state_dict(self.optimizer, sd)
            return
        if partial:
            if names is not None and names != self.local_names:
                raise ConfigError(
                    f"the partial optimizer state is for parameters {sum(names, [])[:4]}..., but this "
                    f"stage holds {sum(self.local_names, [])[:4]}...: the partitioning changed "
                    "since it was saved; load a full checkpoint (saved with partial=False) instead"
                )
            self._load_local(sd)
            return
        keys = [k for group in (self.keys or []) for k in group]
        if len(sd["param_groups"]) != len(self.local_names) or sum(
            len(g["params"]) for g in sd["param_groups"]
        ) != len(keys):
            raise ConfigError(
                f"the optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} "
                f"parameters in {len(sd['param_groups'])} groups, but this optimizer was built over "
                f"{len(keys)} in {len(self.local_names)}; build it as when it was saved"
            )
        full_ids = [i for g in sd["param_groups"] for i in g["params"]]
        id_of = dict(zip(keys, full_ids))
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [id_of[n] for n in names]}
            for g, names in zip(sd["param_groups"], self.local_names)
        ]
        wanted = {i for g in groups for i in g["params"]}
        self._load_local(
            {"state": {i: s for i, s in sd["state"].items() if i in wanted}, "param_groups": groups}
        )


_SEED_FUNCTIONS = {name: _seed_method(name) for name in _SEED_METHODS}
