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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import ConfigError
from fxpipe.runtime.api.model import PARTIAL_KEY
from fxpipe.runtime.api.state import current

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


class DistributedOptimizer:
    """Make ``optimizer`` pipeline-aware (see Note [optimizer in place]); returns the same object.

    Example::

        optimizer = fxpipe.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """

    _fxpipe_keys: list[list[str]] | None
    _fxpipe_pending: dict[str, Any] | None

    def __new__(cls, optimizer: torch.optim.Optimizer) -> Any:
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        st = current()
        optimizer.__class__ = _subclass(type(optimizer))
        optimizer._fxpipe_keys = None       # original keys per group, all parameters (after localizing)
        optimizer._fxpipe_pending = None    # a partial state dict loaded before partitioning
        st.optimizers.append(optimizer)
        if st.model is not None and st.model.partitioned:
            optimizer._fxpipe_localize(st.model)  # type: ignore[attr-defined]
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
        if opt._fxpipe_pending is not None:
            pending, opt._fxpipe_pending = opt._fxpipe_pending, None
            self.load_state_dict(pending)

    @property
    def _fxpipe_localized(self) -> bool:
        return getattr(self, "_fxpipe_keys", None) is not None

    # -- state dicts -----------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's optimizer state (torch's format), marked partial, with each parameter's key."""
        sd = super().state_dict()  # type: ignore[misc]
        if self._fxpipe_localized:
            sd[_NAMES] = [list(names) for names in self._fxpipe_local_names]
        sd[PARTIAL_KEY] = True
        return sd

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
            super().load_state_dict(sd)  # type: ignore[misc]
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
        super().load_state_dict({"state": {i: s for i, s in sd["state"].items() if i in wanted},  # type: ignore[misc]
                                 "param_groups": groups})
