"""A compiled stage checked against its own code run eagerly, at the warm-up, before the first step.

Note [checking a compiled stage at the warm-up]: a compiler can compute something other than the
code it compiles (inductor's vectorized CPU kernels and the zoo Falcon's attention backward:
docs/compile.md), and a run that trains on such numbers is the worst outcome a compiled run can
have: it trains, on wrong gradients. ``fxpipe verify --compile`` compares the whole model by hand;
this check runs in every compiled run. After a stage's warm-up compiled it, the stage's forward
and backward run once more on the warm-up's inputs, compiled and eagerly (the compiled regions
under ``torch.compiler.set_stance("force_eager")``), from the same seed, and the outputs, the
gradients of the received tensors and of the parameters are compared by the rule the safety net
uses (Note [one comparison rule] in ``fxpipe.codegen.check.equivalence``), with tolerances wide
enough for kernels that only round otherwise (fp32: rtol 1e-3, atol 1e-5; a stage computing in
bf16 or fp16, under autocast or FSDP's ``param_dtype``, or reducing its gradients in it, and a
CUDA stage whose fp32 products run in TF32, 5e-2 and 1e-3; and no tensor held closer than rtol
x 1% of the stage's largest value, for sums that cancel to about 0, whose noise is the size of
their terms):
a 2% error in fp32 or a NaN fails the start with the stage and the tensor named, silent noise
does not. A stage that draws random numbers (dropout: two eager runs from other seeds differ)
cannot be compared so (inductor draws its own) and is reported unchecked. The effects are undone
as the warm-up's are (gradients, buffers, modes, random state). A build
with dynamic dimensions is checked at both of the warm-up's sizes; where the warm-up compiles the
eval graphs (Note [compiled eval graphs] in ``fxpipe.runtime.pipeline.compiled``), their forward
is checked too, in eval mode, where dropout draws nothing: a stage with dropout is checked there.
Stages sharded by FSDP or split by tensor parallelism are checked through their collectives
(Note [checking sharded stages]).

Note [checking sharded stages]: the parameters of a stage compiled inside FSDP units
(``--shard``) or split by tensor parallelism (``--tp``) are DTensors, and its forward and
backward are collectives: FSDP's are warmed up after the wrap, every replica alike (Note
[compiling under FSDP] in ``fxpipe.runtime.pipeline.compiled``), tensor parallelism's after the
split, every shard alike, and so is the check. Each rank compares its own part of every
DTensor (a gradient's shard, a head's logits split over the vocabulary, whose random output
gradient is laid out as they are, each rank taking its part of one whole); then the ranks that
share the parameters (the mesh of their DTensors, one ``all_gather_object`` per mesh dimension)
exchange their verdicts, so every one reports the same worst tensor and stops, or runs,
together: a rank that raised alone would leave the others waiting in their first step. Whether
the stage draws random numbers is agreed the same way before the compiled run, whose
collectives every rank must join.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from fxpipe.codegen.check.equivalence import TensorError, compare_tensor, rows_by_error
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.pipeline.recompute import checkpointed
from fxpipe.tracer.seeding import seeded

__all__ = [
    "CHECK_TOLERANCES",
    "CompiledMismatchError",
    "EagerCheck",
    "check_against_eager",
    "run_stage",
    "state_undone",
]

# (rtol, atol) per half-precision dtype the stage computes in (None: fp32): under bf16 a gradient
# that cancels to about 0 eagerly is a few 1e-5 compiled (the GPT example's tied embedding)
CHECK_TOLERANCES = {None: (1e-3, 1e-5), torch.bfloat16: (5e-2, 1e-3), torch.float16: (5e-2, 1e-3)}
_FLOOR = 1e-2  # of the stage's largest compared value, times rtol: the least error allowed


class CompiledMismatchError(RuntimeSetupError):
    """A compiled stage computes something other than its code (Note [checking a compiled stage
    at the warm-up])."""


@dataclass(frozen=True)
class EagerCheck:
    """The compiled stage against its eager code: ``worst`` the tensor furthest off (None when
    ``random``: the stage draws random numbers, unchecked), ``failing`` how many are off."""

    random: bool
    worst: TensorError | None = None
    failing: int = 0
    compared: int = 0

    @property
    def ok(self) -> bool:
        return self.failing == 0


@contextlib.contextmanager
def state_undone(module: nn.Module, training: bool) -> Iterator[None]:
    """Run the block with ``module`` in train (``training``) or eval mode, then put back its
    gradients, buffers, modes, and torch's, numpy's and Python's random state."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    grads = {p: p.grad for p in module.parameters()}
    modes = {m: m.training for m in module.modules()}
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
    module.train(training)
    try:
        with seeded(None, cuda):
            yield
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        for p, g in grads.items():
            p.grad = g
        for m, was in modes.items():
            m.training = was


def run_stage(
    module: nn.Module,
    args: Sequence[torch.Tensor],
    recompute: bool,
    mutated: Sequence[int],
    output_grad: Callable[[torch.Tensor], torch.Tensor],
) -> list[Any]:
    """``module``'s forward on ``args`` as ``StageWorker`` runs it (the inputs at ``mutated``
    copied first, under ``torch.utils.checkpoint`` if ``recompute`` and grad is on), then, for the
    outputs that need one, the backward from ``output_grad(output)``; the outputs."""
    fed = [a.clone() if i in mutated else a for i, a in enumerate(args)]
    out = checkpointed(module, *fed) if recompute and torch.is_grad_enabled() else module(*fed)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    roots = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if roots:
        torch.autograd.backward(roots, [output_grad(o) for o in roots])
    return outs


def _forward_backward(
    module: nn.Module,
    args: Sequence[torch.Tensor],
    recompute: bool,
    mutated: Sequence[int],
    seed: int,
    training: bool = True,
) -> list[tuple[str, torch.Tensor | None]]:
    """Outputs, received tensors' gradients and parameters' gradients of one forward and backward
    from ``seed``, the output gradients drawn from a generator of their own (not ones: a
    LayerNorm's input gradient for a constant output gradient cancels to about 0, noise); not
    ``training``: the outputs of one forward under ``no_grad``, as ``eval_step`` runs it."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    leaves = [a.detach().requires_grad_(a.requires_grad) for a in args]  # as the warm-up's
    gen = torch.Generator().manual_seed(0)
    with torch.set_grad_enabled(training):
        outs = run_stage(module, leaves, recompute, mutated, lambda o: _random_like(o, gen))
    got: list[tuple[str, torch.Tensor | None]] = [
        (f"output[{i}]", _local(o.detach()) if isinstance(o, torch.Tensor) else None)
        for i, o in enumerate(outs)
    ]
    if not training:
        return got
    got += [(f"grad of input[{i}]", a.grad) for i, a in enumerate(leaves) if a.requires_grad]
    got += [(f"grad {k}", _local(p.grad)) for k, p in module.named_parameters() if p.requires_grad]
    return got


def _random_like(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random gradient for ``out`` from ``gen``; for a DTensor output (a tensor-parallel head's
    logits split over the vocabulary) a DTensor laid out as it is, each rank taking its part of
    the same whole (``gen`` draws alike on every rank)."""
    whole = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    if not isinstance(out, DTensor):
        return whole
    placements = [Replicate() if p.is_partial() else p for p in out.placements]
    return distribute_tensor(whole, out.device_mesh, placements, src_data_rank=None)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (an FSDP or tensor-parallel parameter's gradient, a split
    output); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _half_precision(got: list[tuple[str, torch.Tensor | None]]) -> torch.dtype | None:
    """bf16 or fp16 when a stage's outputs or gradients come in it (the stage computes in half
    precision, whether under autocast, FSDP's ``param_dtype`` or casts of its own); else None."""
    dtypes = {t.dtype for _, t in got if t is not None}
    return next((d for d in (torch.bfloat16, torch.float16) if d in dtypes), None)


def _tf32(module: nn.Module, got: list[tuple[str, torch.Tensor | None]]) -> torch.dtype | None:
    """fp16 (TF32's 10-bit mantissa) when a CUDA stage's fp32 products run in TF32: matmuls
    under ``torch.set_float32_matmul_precision("high")``, or convolutions (cuDNN's TF32 is on by
    default); eager and compiled pick other kernels, each rounding in TF32. Else None."""
    if not any(t is not None and t.is_cuda for _, t in got):
        return None
    convolves = any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
    tf32 = torch.backends.cuda.matmul.allow_tf32 or (convolves and torch.backends.cudnn.allow_tf32)
    return torch.float16 if tf32 else None


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in a floating tensor (0 for others)."""
    if not t.is_floating_point() or not t.numel():
        return 0.0
    return float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())


def _same(
    a: list[tuple[str, torch.Tensor | None]], b: list[tuple[str, torch.Tensor | None]]
) -> bool:
    return all(
        (x is None and y is None)
        or (x is not None and y is not None and torch.equal(x.nan_to_num(), y.nan_to_num()))
        for (_, x), (_, y) in zip(a, b)
    )


def _sharing(module: nn.Module) -> DeviceMesh | None:
    """The mesh of the ranks that share ``module``'s parameters as DTensors (FSDP's replicas,
    tensor parallelism's shards, or both: the mesh of most dimensions); None: plain tensors."""
    meshes = [p.device_mesh for p in module.parameters() if isinstance(p, DTensor)]
    return max(meshes, key=lambda m: m.ndim, default=None)


def _agreed(value: Any, mesh: DeviceMesh | None, merge: Callable[[list[Any]], Any]) -> Any:
    """``merge`` of ``value`` over every rank of ``mesh``, the same on all of them (one
    ``all_gather_object`` per mesh dimension; ``value`` itself without a mesh)."""
    if mesh is None:
        return value
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        values: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(values, value, group=group)
        value = merge(values)
    return value


def _worst_of(checks: list[EagerCheck]) -> EagerCheck:
    """The checks of ranks that each compared their own shards, as one: the tensor furthest off
    its allowance on any of them, and the most tensors off on one."""
    rows = [c.worst for c in checks if c.worst is not None]
    worst = max(rows, key=lambda r: r.max_abs / max(r.allowed, 1e-30), default=None)
    return EagerCheck(False, worst, max(c.failing for c in checks), checks[0].compared)


def check_against_eager(
    module: nn.Module,
    args: Sequence[torch.Tensor],
    recompute: bool = False,
    mutated: Sequence[int] = (),
    half: torch.dtype | None = None,
    training: bool = True,
) -> EagerCheck:
    """``module`` (compiled, warmed up on ``args``) against its eager code on ``args``
    (Note [checking a compiled stage at the warm-up]); its effects undone. ``half``: the half
    precision the stage computes in (autocast's, FSDP's ``param_dtype``: its outputs and
    gradients may still come in fp32), held to that precision's tolerance; without it, a stage
    whose outputs or gradients come in bf16 or fp16 is. Not ``training``: its eval graphs, the
    forward in eval mode under ``no_grad``."""
    run = functools.partial(
        _forward_backward, module, args, recompute and training, mutated, training=training
    )
    mesh = _sharing(module)  # Note [checking sharded stages]
    with state_undone(module, training):
        with torch.compiler.set_stance("force_eager"):
            want = run(0)
            if _agreed(not _same(want, run(1)), mesh, any):
                return EagerCheck(random=True)
        got = run(0)
    # a stage that computes in half precision (autocast, FSDP's param_dtype, casts of its own)
    reduced = half or _half_precision(want) or _tf32(module, want)
    rtol, atol = CHECK_TOLERANCES.get(reduced, CHECK_TOLERANCES[None])
    # a tensor far smaller than the stage's others (a sum that cancels) is held to their scale
    scale = max((_largest(w) for _, w in want if w is not None), default=0.0)
    floor = atol + rtol * _FLOOR * scale
    rows = [compare_tensor(name, g, w, rtol, floor) for (name, g), (_, w) in zip(got, want)]
    ranked = rows_by_error(rows)
    check = EagerCheck(False, ranked[0] if ranked else None, sum(not r.ok for r in rows), len(rows))
    return _agreed(check, mesh, _worst_of)
