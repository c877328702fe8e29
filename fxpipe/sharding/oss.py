"""``OSS``: FairScale's optimizer-state sharding, as torch's ``ZeroRedundancyOptimizer``.

``OSS(params, optim=torch.optim.SGD, group=None, **defaults)`` keeps, on each rank of
``group``, the state of its share of the parameters (ZeRO-1; torch's
``ZeroRedundancyOptimizer``, which after every step broadcasts each rank's updated
share). ``ShardedDataParallel(model, oss)`` turns the parameters into FSDP2 shards, and
the OSS then steps those shards with an optimizer of the same class and options
(gradients and optimizer state sharded, ZeRO-2; ``fsdp.py``). The OSS object stays the
one the user holds (LR schedulers, gradient scalers): its ``param_groups``, ``state``,
``step`` and ``zero_grad`` are those of whichever optimizer does the work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from fxpipe.errors import ConfigError
from fxpipe.sharding._errors import refuse_unsupported

__all__ = ["OSS"]


class OSS(torch.optim.Optimizer):
    """FairScale's ``fairscale.optim.oss.OSS`` over ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    ``optim`` is the optimizer class, ``defaults`` its options (``lr=...``), ``group`` the
    process group (default: the world). ``broadcast_buffer_size``, ``broadcast_fp16`` and
    ``force_broadcast_object`` have no torch counterpart and must stay at their defaults.

    >>> optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-4)   # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[Any],
        optim: type[torch.optim.Optimizer] = torch.optim.SGD,
        group: dist.ProcessGroup | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **defaults: Any,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: every optimizer attribute is the inner optimizer's
        refuse_unsupported(
            "OSS",
            {
                "broadcast_buffer_size": (broadcast_buffer_size, -1),
                "broadcast_fp16": (broadcast_fp16, False),
                "force_broadcast_object": (force_broadcast_object, False),
            },
            "ZeroRedundancyOptimizer broadcasts each rank's updated share in the parameters' dtype",
        )
        self.optim_class = optim
        self.group = group
        self.inner: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            list(params), optimizer_class=optim, process_group=group, **defaults
        )
        self._consolidated: dict[str, Any] | None = None

    @property
    def sharded_by_fsdp(self) -> bool:
        """Whether ``ShardedDataParallel`` made the parameters FSDP shards (ZeRO-2)."""
        return not isinstance(self.inner, ZeroRedundancyOptimizer)

    @property
    def optim(self) -> torch.optim.Optimizer:
        """This rank's optimizer (FairScale's ``OSS.optim``): ZeRO's local one, or the shards' one."""
        return self.inner.optim if isinstance(self.inner, ZeroRedundancyOptimizer) else self.inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def _rebind(self, params: list[torch.nn.Parameter]) -> None:
        """Step ``params`` (the module's FSDP2 shards) from now on, with this OSS's class and options;
        ZeRO and its references to the unsharded parameters are dropped."""
        if len(self.inner.param_groups) != 1:
            raise ConfigError(
                f"ShardedDataParallel needs an OSS with one parameter group, got "
                f"{len(self.inner.param_groups)}"
            )
        options = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        self.inner = self.optim_class(params, **options)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        if isinstance(self.inner, ZeroRedundancyOptimizer):
            return self.inner.step(closure, **kwargs)
        refuse_unsupported("OSS.step", {k: (v, None) for k, v in kwargs.items()})
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    # -- state dicts (FairScale's names) ------------------------------------------------------------------------

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the whole optimizer state on global rank ``recipient_rank`` (collective over the group)."""
        if isinstance(self.inner, ZeroRedundancyOptimizer):
            to = (
                dist.get_group_rank(self.group, recipient_rank)
                if self.group is not None
                else recipient_rank
            )
            self.inner.consolidate_state_dict(to=to)
            return
        from fxpipe.runtime.dataparallel.state_dict import gather_full

        self._consolidated = gather_full(self.inner.state_dict())

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The whole state, after ``consolidate_state_dict`` (on its recipient rank; with
        ``ShardedDataParallel``, on every rank)."""
        refuse_unsupported(
            "OSS.state_dict",
            {"all_ranks": (all_ranks, False)},
            "ZeroRedundancyOptimizer consolidates on one rank",
        )
        if isinstance(self.inner, ZeroRedundancyOptimizer):
            return self.inner.state_dict()
        if self._consolidated is None:
            raise ConfigError("OSS.state_dict(): call consolidate_state_dict() on every rank first")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated) state; each rank keeps its share."""
        if isinstance(self.inner, ZeroRedundancyOptimizer):
            self.inner.load_state_dict(state_dict)
            return
        from fxpipe.runtime.dataparallel.state_dict import shard_optimizer_state

        self.inner.load_state_dict(shard_optimizer_state(state_dict, self.inner))

    def __repr__(self) -> str:
        return f"OSS({self.inner!r})"
