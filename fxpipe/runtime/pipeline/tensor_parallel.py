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

Vocabulary-parallel embeddings and LM heads (Note [vocabulary-parallel] in
``fxpipe.codegen.tp_plan``): an embedding is ``RowwiseParallel(input_layouts=Replicate())``,
a head ``ColwiseParallel(use_local_output=False)``; the stage holding the head keeps its
outputs sharded over the vocabulary as DTensors (the logits) and makes the rest plain (its own
loss), and the loss runs under ``loss_parallel`` (``fxpipe.runtime.pipeline.loss_parallel``).
A weight two modules of one stage share (a tied embedding and head) is shared again after
``parallelize_module`` gives each its own DTensor; ties across stages sum their local shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from fxpipe.codegen.tp_plan import ResolvedStagePlan
from fxpipe.errors import ConfigError
from fxpipe.runtime.local_shard import local_tensor
from fxpipe.runtime.pipeline.layout import RankLayout

__all__ = [
    "tensor_parallel_mesh",
    "stage_mesh",
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


def stage_mesh(layout: RankLayout, device: torch.device) -> DeviceMesh:
    """The 2-D ``(dp, tp)`` mesh of this rank's stage, sliced from the job's ``(dp, pp, tp)`` mesh
    (collective: every rank calls it). Its ``tp`` dim is the stage's tp group, its ``dp`` dim the
    replicas of this rank's shard; FSDP over ``dp`` composes with DTensors on ``tp`` only when both
    come from one root mesh (Note [FSDP over TP] in ``fxpipe.runtime.dataparallel.sharded``)."""
    mesh = init_device_mesh(
        device.type,
        (layout.replicas, layout.num_stages, layout.tensor_parallel),
        mesh_dim_names=("dp", "pp", "tp"),
    )
    return mesh["dp", "tp"]


def tensor_parallel_mesh(layout: RankLayout, device: torch.device) -> DeviceMesh:
    """The job's ``(dp, pp, tp)`` mesh (collective: every rank calls it), and this rank's tp dim."""
    return stage_mesh(layout, device)["tp"]


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


def _plain_but_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """The outputs of the stage holding a vocabulary-parallel head: the logits (sharded over
    their last dimension) stay DTensors, never gathered; the rest (its own loss) plain."""
    from torch.utils._pytree import tree_map

    from fxpipe.runtime.pipeline.loss_parallel import sharded_logits

    keep = {id(x) for x in sharded_logits(output)}
    return tree_map(lambda x: x if id(x) in keep else _plain_out(module, args, x), output)


class _ReplicateGradInputs(TorchFunctionMode):
    """Plain tensors that need a gradient and meet a DTensor become replicated DTensors through
    ``DTensor.from_local`` (so their gradient comes back plain, summed as its placement says),
    not through implicit replication (which would hand a plain tensor a DTensor gradient)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        mesh = next((x.device_mesh for x in flat if isinstance(x, DTensor)), None)
        if mesh is not None:
            flat = [
                DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad
                else x
                for x in flat
            ]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


def _in_replicating_mode(stage: nn.Module) -> None:
    """Run ``stage``'s forward under ``_ReplicateGradInputs``: its own code reads an embedding's
    weight split over the vocabulary (``F.linear(h, self.embed.weight)``, a tied LM head)."""
    forward = stage.forward

    def replicating(*args: Any, **kwargs: Any) -> Any:
        with _ReplicateGradInputs():
            return forward(*args, **kwargs)

    stage.forward = replicating


def _holders(stage: nn.Module) -> list[list[tuple[str, str]]]:
    """(module path, attribute) of each parameter several modules of ``stage`` hold."""
    found: dict[int, list[tuple[str, str]]] = {}
    for path, module in stage.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            if (path, name) not in found.setdefault(id(p), []):
                found[id(p)].append((path, name))
    return [h for h in found.values() if len(h) > 1]


def _retie(stage: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Share each tied weight again after ``parallelize_module`` (Note [vocabulary-parallel]):
    every holder must have been split alike, or not at all."""
    for holders in tied:
        first = getattr(stage.get_submodule(holders[0][0]), holders[0][1])
        for path, name in holders[1:]:
            module = stage.get_submodule(path)
            other = getattr(module, name)
            if other is first:
                continue
            alike = isinstance(first, DTensor) and isinstance(other, DTensor)
            if not alike or first.placements != other.placements:
                where = ", ".join(f"{p}.{n}" for p, n in holders)
                raise ConfigError(
                    f"the tensor-parallel plan splits the tied weight {where} unlike: split all "
                    "its holders over the vocabulary or none (fix the plan, --tp-plan)"
                )
            module.register_parameter(name, first)


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
    made: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": lambda: ColwiseParallel(use_local_output=False),
        "rowwise": RowwiseParallel,
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "vocab_head": lambda: ColwiseParallel(use_local_output=False),
    }
    unknown = sorted({s for s in plan.styles.values() if s not in made})
    if unknown:
        raise ConfigError(
            f"the tensor-parallel plan names styles {unknown}; known: {sorted(made)} (fix the plan)"
        )
    styles: dict[str, ParallelStyle] = {path: made[s]() for path, s in plan.styles.items()}
    tied = _holders(stage)
    parallelize_module(stage, mesh, styles)
    _retie(stage, tied)
    for owner in plan.owners:
        module = stage.get_submodule(owner)
        module.register_forward_pre_hook(_replicated_in(mesh), with_kwargs=True)
        if owner or not plan.head:
            module.register_forward_hook(_plain_out)
    if plan.head:
        stage.register_forward_hook(_plain_but_logits)
        if plan.styles.get(plan.head) == "vocab_embedding":  # a tied head the code calls
            _in_replicating_mode(stage)
    return stage


def implicit_replication_on() -> contextlib.AbstractContextManager[None]:
    """Plain tensors meeting DTensors count as replicated (Note [DTensor regions])."""
    return implicit_replication()


def full_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered into a full tensor (collective over its mesh)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


class _LocalShards(nn.Module):
    """One parameter per parameter of ``stage``: its local shard, sharing storage."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        shards = []
        for p in stage.parameters():
            shard = nn.Parameter(local_tensor(p).detach(), requires_grad=p.requires_grad)
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
            from fxpipe.runtime.pipeline.ties import settled_grad

            for p, shard in self.shadow.pairs:
                p.grad = settled_grad(p)  # a vocabulary-parallel embedding's: a partial sum
                shard.grad = None if p.grad is None else local_tensor(p.grad)
            super().sync_gradients()
            for p, shard in self.shadow.pairs:
                if p.grad is not None and shard.grad is not None:
                    local = local_tensor(p.grad)
                    if local is not shard.grad:
                        local.copy_(shard.grad)

    return TensorParallelReplicas()
