"""``DistributedOptimizer``: the user's own optimizer, moved onto this rank's stage at partitioning.

Note [optimizer in place]: in the seed's scripts the optimizer is built over
``model.parameters()`` *before* the first step partitions the model. Rather than
returning a new object (which LR schedulers and GradScalers built over the old one
would not see), ``DistributedOptimizer(opt)`` returns ``opt`` itself, with its class
switched to a subclass that adds the seed's methods: it stays an instance of its
own optimizer class (``isinstance(opt, torch.optim.SGD)`` holds). Right after
partitioning each param group's ``params`` is replaced by the stage's parameters
with the same original keys, and the group's options (lr, momentum, ...) and any
state are kept: the same class and defaults, rebuilt over the local parameters.

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
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from fxpipe.errors import ConfigError
from fxpipe.smp.driver import StepError
from fxpipe.smp.model import PARTIAL_KEY
from fxpipe.smp.state import current

__all__ = ["DistributedOptimizer"]

_CLASSES: dict[type, type] = {}
_NAMES = "param_names"


def _subclass(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Distributed{base.__name__}", (DistributedOptimizer, base), {})
    return _CLASSES[base]


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


class DistributedOptimizer:
    """Make ``optimizer`` pipeline-aware (see Note [optimizer in place]); returns the same object.

    Example::

        optimizer = fxpipe.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """

    _fxpipe_keys: list[list[str]] | None
    _fxpipe_pending: dict[str, Any] | None
    _fxpipe_zero: ZeroRedundancyOptimizer | None

    def __new__(cls, optimizer: torch.optim.Optimizer) -> Any:
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        st = current()
        optimizer.__class__ = _subclass(type(optimizer))
        opt = cast(DistributedOptimizer, optimizer)  # its class now derives from DistributedOptimizer too
        opt._fxpipe_keys = None       # original keys per group, all parameters (after localizing)
        opt._fxpipe_pending = None    # a partial state dict loaded before partitioning
        opt._fxpipe_zero = None       # the sharded optimizer (Note [sharded optimizer state])
        st.optimizers.append(optimizer)
        if st.model is not None and st.model.partitioned:
            opt._fxpipe_localize(st.model)
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        """Everything happens in ``__new__``, which returns the optimizer itself."""

    # -- partitioning ----------------------------------------------------------

    def _fxpipe_localize(self, model: Any) -> None:
        """Point every param group at this stage's parameters (same original keys)."""
        opt: Any = self
        local: dict[str, torch.nn.Parameter] = {}
        for key, p in model.module.named_parameters(remove_duplicate=False):
            local.setdefault(model.primary_key(key), p)
        stage_ids = {id(p): k for k, p in local.items()}
        keys_per_group, new_state = [], {}
        for group in opt.param_groups:
            keys, params = [], []
            for p in group["params"]:
                key = model.original_key(p) or stage_ids.get(id(p))
                if key is None:
                    raise ConfigError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the "
                                      "DistributedModel; build the optimizer over model.parameters()")
                keys.append(key)
                if key in local:
                    params.append(local[key])
                    if p in opt.state:
                        new_state[local[key]] = opt.state[p]
            group["params"] = params
            keys_per_group.append(keys)
        opt.state.clear()
        opt.state.update(new_state)
        opt._fxpipe_keys = keys_per_group
        self._fxpipe_local_names = [[k for k in keys if k in local] for keys in keys_per_group]
        dp = model.replicas
        if dp.stage is not None and dp.options.shard_optimizer_state and any(g["params"] for g in opt.param_groups):
            self._fxpipe_shard(current().dp_group)
        if opt._fxpipe_pending is not None:
            pending, opt._fxpipe_pending = opt._fxpipe_pending, None
            self.load_state_dict(pending)

    def _fxpipe_shard(self, group: Any) -> None:
        """Build the ZeRO optimizer over the local param groups and move any state into it."""
        opt: Any = self
        base = type(self).__bases__[1]  # the user's optimizer class (see _subclass)
        state = super().state_dict() if opt.state else None  # type: ignore[misc]
        groups = [dict(g) for g in opt.param_groups]
        opt._fxpipe_zero = ZeroRedundancyOptimizer(groups, optimizer_class=base, process_group=group,
                                                   **_constructor_defaults(base, opt.defaults))
        if state is not None:
            self._fxpipe_load_local(state)

    def step(self, closure: Any = None) -> Any:
        """The optimizer step (on this replica's shard when sharded); refused inside an accumulation window."""
        st = current()
        if st.model is not None and st.model.partitioned and not st.model.replicas.synced:
            raise StepError(f"optimizer.step() was called after {st.model.replicas.stage.passes} of "
                            f"backward_passes_per_step={st.model.ddp_options.backward_passes_per_step} steps, before "
                            "the gradients were averaged over the replicas; call it (and zero_grad) only every "
                            "backward_passes_per_step-th step")
        zero = getattr(self, "_fxpipe_zero", None)
        if zero is None:
            return super().step(closure)  # type: ignore[misc]
        for mine, theirs in zip(self.param_groups, zero.param_groups):  # type: ignore[attr-defined]
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        return zero.step(closure)

    # the base class's step is already wrapped with torch's step hooks and runs them; keep
    # Optimizer._patch_step_function (on unpickling) from wrapping this one too
    step.hooked = True  # type: ignore[attr-defined]

    @property
    def _fxpipe_localized(self) -> bool:
        return getattr(self, "_fxpipe_keys", None) is not None

    # -- state dicts -----------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's optimizer state (torch's format), marked partial, with each parameter's key."""
        sd = super().state_dict()  # type: ignore[misc]
        if getattr(self, "_fxpipe_zero", None) is not None:
            sd["state"] = self._fxpipe_gather_shards()
        if self._fxpipe_localized:
            sd[_NAMES] = [list(names) for names in self._fxpipe_local_names]
        sd[PARTIAL_KEY] = True
        return sd

    def _fxpipe_gather_shards(self) -> dict[int, Any]:
        """Every replica's share of the state, numbered as ``state_dict`` numbers the local parameters (collective)."""
        zero: Any = self._fxpipe_zero
        params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        index = {id(p): i for i, p in enumerate(params)}
        mine = {index[id(p)]: _to_cpu(s) for p, s in zero.optim.state.items()}
        parts: list[Any] = [None] * dist.get_world_size(zero.process_group)
        dist.all_gather_object(parts, mine, group=zero.process_group)
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items()))

    def _fxpipe_load_local(self, sd: dict[str, Any]) -> None:
        """Load a torch-format state dict of the local parameters (into the ZeRO shard when sharded)."""
        zero = getattr(self, "_fxpipe_zero", None)
        if zero is None:
            super().load_state_dict(sd)  # type: ignore[misc]
            return
        # ZeRO looks state up by position among the local parameters: renumber the saved ids 0..n-1
        renumber = {old: new for new, old in enumerate(i for g in sd["param_groups"] for i in g["params"])}
        groups = [{**g, "params": [renumber[i] for i in g["params"]]} for g in sd["param_groups"]]
        state = {renumber[i]: v for i, v in sd["state"].items() if i in renumber}
        super().load_state_dict({"state": {}, "param_groups": groups})  # type: ignore[misc]  # the options
        zero.load_state_dict({"state": state, "param_groups": [dict(g) for g in groups]})

    def state_dict(self) -> dict[str, Any]:
        """The whole model's optimizer state, numbered as a one-process optimizer's (collective)."""
        if not self._fxpipe_localized:
            return super().state_dict()  # type: ignore[misc]
        st = current()
        mine = _to_cpu(self.local_state_dict())
        parts: list[Any] = [None] * st.layout.num_stages
        dist.all_gather_object(parts, mine, group=st.mp_group if st.layout.replicas > 1 else None)
        keys = self._fxpipe_keys or []
        index = {k: i for i, k in enumerate(k for group in keys for k in group)}
        state: dict[int, Any] = {}
        for part in parts:
            for names, group in zip(part[_NAMES], part["param_groups"]):
                for name, local_id in zip(names, group["params"]):
                    if local_id in part["state"]:
                        state.setdefault(index[name], part["state"][local_id])
        groups = []
        for own, group_keys in zip(mine["param_groups"], keys):
            groups.append({**{k: v for k, v in own.items() if k != "params"},
                           "params": [index[k] for k in group_keys]})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (``state_dict``) or partial (``local_state_dict``) optimizer state."""
        sd = dict(state_dict)
        partial = bool(sd.pop(PARTIAL_KEY, False))
        names = sd.pop(_NAMES, None)
        if not self._fxpipe_localized:
            if partial:
                self._fxpipe_pending = {**sd, PARTIAL_KEY: True, _NAMES: names}
                return
            super().load_state_dict(sd)  # type: ignore[misc]
            return
        if partial:
            if names is not None and names != self._fxpipe_local_names:
                raise ConfigError(f"the partial optimizer state is for parameters {sum(names, [])[:4]}..., but this "
                                  f"stage holds {sum(self._fxpipe_local_names, [])[:4]}...: the partitioning changed "
                                  "since it was saved; load a full checkpoint (saved with partial=False) instead")
            self._fxpipe_load_local(sd)
            return
        keys = [k for group in (self._fxpipe_keys or []) for k in group]
        if len(sd["param_groups"]) != len(self._fxpipe_local_names) or \
                sum(len(g["params"]) for g in sd["param_groups"]) != len(keys):
            raise ConfigError(f"the optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} "
                              f"parameters in {len(sd['param_groups'])} groups, but this optimizer was built over "
                              f"{len(keys)} in {len(self._fxpipe_local_names)}; build it as when it was saved")
        full_ids = [i for g in sd["param_groups"] for i in g["params"]]
        id_of = dict(zip(keys, full_ids))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [id_of[n] for n in names]}
                  for g, names in zip(sd["param_groups"], self._fxpipe_local_names)]
        wanted = {i for g in groups for i in g["params"]}
        self._fxpipe_load_local({"state": {i: s for i, s in sd["state"].items() if i in wanted},
                                 "param_groups": groups})
