"""FairScale's ``ShardedDataParallel`` and ``FullyShardedDataParallel`` over FSDP2's ``fully_shard``.

Note [sharded in place]: FSDP2 shards a module in place: ``fully_shard(m)`` turns its
parameters into DTensor shards and changes its class to ``FSDP<Class>``, keeping every
attribute and every state-dict key. FairScale's wrappers are calls that return the
wrapped module, so here too ``FullyShardedDataParallel(module, ...)`` and
``ShardedDataParallel(module, optimizer)`` return ``module`` itself, sharded, with its
class extended once more by the wrapper class (a real subclass: ``isinstance(m,
FullyShardedDataParallel)`` holds, ``m.linear1`` is still ``m.linear1``, and the keys
are the original ones). The wrapper class adds FairScale's attributes
(``mixed_precision``, ``flatten_parameters``, ``reshard_after_forward``,
``process_group``) and methods: ``state_dict()`` / ``load_state_dict()`` are the *full*
state (whole tensors, gathered; collective, as in FairScale), ``local_state_dict()`` the
shards, ``no_sync()`` accumulates without reducing, ``clip_grad_norm_``.

* ``FullyShardedDataParallel`` = ``fully_shard(reshard_after_forward=True)`` (ZeRO-3);
  ``mixed_precision=True`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=compute_dtype
  or float16, reduce_dtype=float32 if fp32_reduce_scatter else that dtype)``.
* ``ShardedDataParallel(module, oss)`` = ``fully_shard(reshard_after_forward=False)``
  (ZeRO-2: gradients and optimizer state sharded, parameters gathered once per
  forward/backward) and the ``OSS`` re-pointed at the shards (``oss.py``).

Both start every rank from the first rank's weights (FairScale's
``sync_models_at_startup``; FSDP2 itself shards whatever each rank holds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel.state_dict import gather_full, shard_like
from fxpipe.runtime.dataparallel.sharded import broadcast_state
from fxpipe.sharding._errors import refuse_unsupported
from fxpipe.sharding.oss import OSS

__all__ = ["FullyShardedDataParallel", "ShardedDataParallel"]


def _mesh(group: dist.ProcessGroup | None, module: nn.Module) -> DeviceMesh:
    param = next(module.parameters(), None)
    device = (
        param.device.type if param is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    return DeviceMesh.from_group(_or_world(group), device)


def _or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    world = group if group is not None else dist.group.WORLD
    assert world is not None, "the default process group is initialised"
    return world


def _extend_class(module: nn.Module, wrapper: type) -> None:
    """Make ``module`` an instance of ``wrapper`` too (Note [sharded in place])."""
    cls = type(module)
    if not issubclass(cls, wrapper):
        module.__class__ = type(f"{wrapper.__name__}{cls.__name__}", (wrapper, cls), {})


class _WrapInPlace(type):
    """Calling the class shards the module in place and returns it (Note [sharded in place])."""

    def __call__(cls, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        cls._shard(module, *args, **kwargs)  # type: ignore[attr-defined]
        _extend_class(module, cls)
        return module


class _ShardedModule(nn.Module, metaclass=_WrapInPlace):
    """What both FairScale wrappers add to a module sharded by ``fully_shard`` (full state dicts, no_sync...)."""

    process_group: dist.ProcessGroup | None

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """The full state dict: whole tensors under the original keys (collective over the group, as
        FairScale's). Called by an enclosing module's ``state_dict`` it adds its shards, as FSDP2 does."""
        if args or destination is not None or prefix:
            return nn.Module.state_dict(
                self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        return gather_full(nn.Module.state_dict(self, keep_vars=keep_vars))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (whole tensors, original keys): each rank keeps its shards."""
        refuse_unsupported(f"{type(self).__name__}.load_state_dict", {"assign": (assign, False)})
        local = nn.Module.state_dict(self)
        return nn.Module.load_state_dict(
            self,
            {k: shard_like(v, local[k]) if k in local else v for k, v in state_dict.items()},
            strict=strict,
        )

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shards (DTensors), for ``torch.distributed.checkpoint``."""
        return nn.Module.state_dict(self)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (FSDP2's ``set_requires_gradient_sync(False)``)."""
        assert isinstance(self, FSDPModule)
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' total norm over all shards (``torch.nn.utils.clip_grad_norm_`` on DTensors)."""
        norm = torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class FullyShardedDataParallel(_ShardedModule):
    """FairScale's ``FullyShardedDataParallel`` (parameters, gradients and optimizer state sharded).

    ``FullyShardedDataParallel(module, process_group=None, reshard_after_forward=True,
    mixed_precision=False, fp32_reduce_scatter=False, flatten_parameters=True,
    move_params_to_cpu=False, compute_dtype=None, cpu_offload=False, ...)`` returns
    ``module``, sharded in place (Note [sharded in place]); build the optimizer over
    its parameters afterwards. FairScale options without an FSDP2 counterpart are
    refused when set (``flatten_parameters=False``: FSDP2 always gathers a unit's
    parameters as one flat buffer).
    """

    mixed_precision: bool
    flatten_parameters: bool
    reshard_after_forward: bool

    @staticmethod
    def _shard(
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        move_grads_to_cpu: bool | None = None,
        bucket_cap_mb: int = 25,
        compute_device: torch.device | None = None,
        no_broadcast_optim_state: bool = False,
        state_dict_device: torch.device | None = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        offload = move_params_to_cpu or cpu_offload
        refuse_unsupported(
            "FullyShardedDataParallel",
            {
                "flatten_parameters": (flatten_parameters, True),
                "buffer_dtype": (buffer_dtype, None),
                "move_grads_to_cpu": (
                    move_grads_to_cpu,
                    None if move_grads_to_cpu is None else offload,
                ),
                "bucket_cap_mb": (bucket_cap_mb, 25),
                "no_broadcast_optim_state": (no_broadcast_optim_state, False),
                "state_dict_device": (state_dict_device, None),
                "clear_autocast_cache": (clear_autocast_cache, False),
                "force_input_to_fp32": (force_input_to_fp32, False),
                "verbose": (verbose, False),
                **{k: (v, "(no such FairScale argument)") for k, v in kwargs.items()},
            },
        )
        if compute_dtype is not None and not mixed_precision:
            raise ConfigError(
                "FullyShardedDataParallel: compute_dtype is used with mixed_precision=True"
            )
        if fp32_reduce_scatter and not mixed_precision:
            raise ConfigError(
                "FullyShardedDataParallel: fp32_reduce_scatter=True needs mixed_precision=True"
            )
        if compute_device is not None:
            module.to(compute_device)
        param_dtype = (compute_dtype or torch.float16) if mixed_precision else None
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=torch.float32 if fp32_reduce_scatter else param_dtype,
        )
        if not isinstance(
            module, FSDPModule
        ):  # sync_models_at_startup: inner units were synced by their own call
            broadcast_state(module, process_group)
        fully_shard(
            module,
            mesh=_mesh(process_group, module),
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
        )
        module.mixed_precision = mixed_precision  # type: ignore[assignment]
        module.flatten_parameters = flatten_parameters  # type: ignore[assignment]
        module.reshard_after_forward = reshard_after_forward  # type: ignore[assignment]
        module.process_group = process_group  # type: ignore[assignment]


class ShardedDataParallel(_ShardedModule):
    """FairScale's ``ShardedDataParallel`` (gradients and optimizer state sharded, ZeRO-2).

    ``ShardedDataParallel(module, sharded_optimizer, process_group=None,
    broadcast_buffers=True, sync_models_at_startup=True, reduce_buffer_size=2**23,
    auto_refresh_trainable=True, reduce_fp16=False, warn_on_trainable_params_changed=True)``
    returns ``module`` sharded in place with ``fully_shard(reshard_after_forward=False)``
    and points ``sharded_optimizer`` (an ``OSS``) at the shards. Buffers are broadcast
    from the first rank before every forward (``broadcast_buffers``, as DDP does).
    """

    @staticmethod
    def _shard(
        module: nn.Module,
        sharded_optimizer: OSS | list[OSS],
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
    ) -> None:
        refuse_unsupported(
            "ShardedDataParallel",
            {
                "reduce_buffer_size": (reduce_buffer_size, 2**23),
                "auto_refresh_trainable": (auto_refresh_trainable, True),
                "reduce_fp16": (reduce_fp16, False),
                "warn_on_trainable_params_changed": (warn_on_trainable_params_changed, True),
            },
            "FSDP2 reduce-scatters each unit's gradients in one bucket, in the parameters' dtype",
        )
        optimizers = (
            sharded_optimizer if isinstance(sharded_optimizer, list) else [sharded_optimizer]
        )
        if len(optimizers) != 1 or not isinstance(optimizers[0], OSS):
            raise ConfigError(
                f"ShardedDataParallel takes one fxpipe.sharding.OSS optimizer, got "
                f"{[type(o).__name__ for o in optimizers]}"
            )
        oss = optimizers[0]
        group = process_group if process_group is not None else oss.group
        if sync_models_at_startup:
            broadcast_state(module, group)
        fully_shard(module, mesh=_mesh(group, module), reshard_after_forward=False)
        oss._rebind([p for p in module.parameters() if p.requires_grad])
        module.process_group = group  # type: ignore[assignment]
        if broadcast_buffers and any(True for _ in module.buffers()):
            module.register_forward_pre_hook(lambda m, args: broadcast_state_buffers(m, group))


def broadcast_state_buffers(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Broadcast ``module``'s buffers from the group's first rank (DDP's ``broadcast_buffers``)."""
    with torch.no_grad():
        for b in module.buffers():
            dist.broadcast(b, group=group, group_src=0)
