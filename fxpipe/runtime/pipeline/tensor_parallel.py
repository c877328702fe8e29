"""Tensor parallelism inside a stage: the tp mesh and a build's plan applied with DTensor.

A job of ``replicas x pipeline ranks x T`` processes forms the device mesh
``(dp, pp, tp)``, tp innermost (``RankLayout``: neighbouring ranks share a stage, so the
per-layer all-reduces stay on the fastest link). Each stage is loaded whole on its T ranks,
then ``parallelize_module`` splits the linears the build's plan names
(``fxpipe.codegen.tp_plan``): ``ColwiseParallel`` and ``RowwiseParallel``, torch's own.

Note [DTensor regions]:
The emitted forward of an attention block reshapes with literal sizes
(``q.view([b, 16, -1, 8])``, ``expand([b, 2, 2, 16, 8])``): they are the model's global
sizes. Column-parallel outputs are therefore kept as DTensors (``use_local_output=False``),
whose shapes are global and whose ops run on the local shard, so the emitted code is right
unchanged on any degree; the row-parallel linear all-reduces its output back to a plain,
replicated tensor. Each module holding a pair (its ``owner``) converts its tensor inputs to replicated DTensors
(``DTensor.from_local``, so gradients flow back through an all-reduce) and its outputs to
plain tensors, and implicit replication is on while a runner lives: every plain tensor in a
tp group is replicated by construction (the stage's inputs, replicated parameters, tensors made
inside ``forward``). So a stage's inputs and outputs are plain, replicated tensors, and P2P
between stages goes from each tp rank to its peer of the same tp index. CPU attention
(``_scaled_dot_product_flash_attention_for_cpu``) has no DTensor rule in torch 2.13 (its
decomposition's propagation runs for minutes): ``register_cpu_attention`` gives it torch's
CUDA rule, heads sharded in and out.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from fxpipe.codegen.tp_plan import ResolvedStagePlan
from fxpipe.errors import ConfigError
from fxpipe.runtime.pipeline.layout import RankLayout

__all__ = [
    "tensor_parallel_mesh",
    "parallelize_stage",
    "register_cpu_attention",
    "implicit_replication_on",
    "full_state_dict",
    "tensor_parallel_replicas",
]

_registered = False


def register_cpu_attention() -> None:
    """DTensor sharding rules for CPU's fused attention and its backward: all replicated, or
    heads (dim 1) sharded, or batch (dim 0) sharded; the mask replicated. Idempotent."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        expand_to_full_mesh_op_strategy,
        register_op_strategy,
    )

    aten = torch.ops.aten

    def tensors(op_schema: Any) -> int:
        return len(op_schema.args_strategy) + len(op_schema.kwargs_strategy)

    @register_op_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        schema_info=RuntimeSchemaInfo(3),
    )
    def _forward(op_schema: Any) -> Any:
        n = tensors(op_schema)  # q, k, v and the mask when there is one
        rest: list[Any] = [Replicate()] * (n - 3)
        strategies: list[list[Any]] = [
            [Replicate()] * (2 + n),
            [Shard(1)] * 5 + rest,
            [Shard(0)] * (2 + n),
        ]
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2
        )

    @register_op_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        schema_info=RuntimeSchemaInfo(6),
    )
    def _backward(op_schema: Any) -> Any:
        n = tensors(op_schema)  # grad_out, q, k, v, out, logsumexp and the mask
        rest: list[Any] = [Replicate()] * (n - 6)
        strategies: list[list[Any]] = [
            [Replicate()] * (3 + n),
            [Shard(1)] * 9 + rest,
            [Shard(0)] * (3 + n),
        ]
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(validate=False), op_schema, strategies, input_index=3
        )

    _registered = True


def tensor_parallel_mesh(layout: RankLayout, device: torch.device) -> DeviceMesh:
    """The job's ``(dp, pp, tp)`` mesh (collective: every rank calls it), and this rank's tp dim."""
    mesh = init_device_mesh(
        device.type,
        (layout.replicas, layout.num_stages, layout.tensor_parallel),
        mesh_dim_names=("dp", "pp", "tp"),
    )
    return mesh["tp"]


def _replicated_in(mesh: DeviceMesh) -> Any:
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    return hook


def _plain_out(module: nn.Module, args: Any, output: Any) -> Any:
    from torch.utils._pytree import tree_map

    def convert(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.redistribute(x.device_mesh, [Replicate()]).to_local()
        return x

    return tree_map(convert, output)


def parallelize_stage(stage: nn.Module, plan: ResolvedStagePlan, mesh: DeviceMesh) -> nn.Module:
    """Split ``stage``'s linears as ``plan`` says over ``mesh`` (Note [DTensor regions]);
    every other parameter stays a plain tensor, replicated."""
    if not plan.styles:
        return stage
    register_cpu_attention()
    names = dict(stage.named_modules())
    for path in [*plan.styles, *plan.owners]:
        if path not in names:
            raise ConfigError(
                f"the tensor-parallel plan names module {path!r}, which this stage "
                f"({type(stage).__name__}) does not have; fix the plan (--tp-plan) or repartition"
            )
    styles: dict[str, ParallelStyle] = {
        path: ColwiseParallel(use_local_output=False) if style == "colwise" else RowwiseParallel()
        for path, style in plan.styles.items()
    }
    parallelize_module(stage, mesh, styles)
    for owner in plan.owners:
        module = stage.get_submodule(owner)
        module.register_forward_pre_hook(_replicated_in(mesh), with_kwargs=True)
        module.register_forward_hook(_plain_out)
    return stage


def implicit_replication_on() -> contextlib.AbstractContextManager[None]:
    """Plain tensors meeting DTensors count as replicated (Note [DTensor regions])."""
    return implicit_replication()


def full_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered into a full tensor (collective over its mesh)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard, a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _LocalShards(nn.Module):
    """One parameter per parameter of ``stage``: its local shard, sharing storage."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        shards = []
        for p in stage.parameters():
            shard = nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad)
            shards.append(shard)
            self.pairs.append((p, shard))
        self.shards = nn.ParameterList(shards)


def tensor_parallel_replicas(
    stage: nn.Module, group: Any, options: Any, device: torch.device
) -> Any:
    """DDP over the data-parallel group for a tensor-parallel stage (Note [TP under DDP])."""
    from fxpipe.runtime.dataparallel import DataParallelStage

    class TensorParallelReplicas(DataParallelStage):
        """``DataParallelStage`` on the local shards of a tensor-parallel stage.

        Note [TP under DDP]: DDP does not take DTensor parameters, but every rank of one tp
        index holds the same shard of each split parameter, so the replicas of a shard are
        kept in sync as plain tensors. DDP wraps a module of parameters sharing storage with
        the local shards; before its synchronising pass (Note [one all-reduce per step] in
        ``fxpipe.runtime.dataparallel.replica``) each shard parameter's ``.grad`` is set to the
        local gradient tensor itself, so DDP's average lands in the stage's gradients.
        """

        def __init__(self) -> None:
            self.shadow = _LocalShards(stage)
            super().__init__(self.shadow, group, options, device)

        def sync_gradients(self) -> None:
            for p, shard in self.shadow.pairs:
                shard.grad = None if p.grad is None else _local(p.grad)
            super().sync_gradients()
            for p, shard in self.shadow.pairs:
                if p.grad is not None and shard.grad is not None:
                    local = _local(p.grad)
                    if local is not shard.grad:
                        local.copy_(shard.grad)

    return TensorParallelReplicas()
