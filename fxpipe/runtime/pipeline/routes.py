"""Routes: which boundary tensor travels from which stage to which, read from a manifest.

Plain data, no torch. Every tensor goes straight from its producer to each consumer
(skipping the stages in between). Model outputs produced before the last stage are
routed to the last stage, which computes the loss. A gradient travels back along a
route only when the tensor requires one and is floating point (token ids and masks
get none).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest
from fxpipe.errors import BuildDirError
from fxpipe.partitioner.schedule import Link

__all__ = ["Transfer", "Routes", "routes_from_manifest", "needs_grad"]

_FLOATING = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128"}


def needs_grad(spec: BoundaryTensor) -> bool:
    """Whether a gradient for this tensor is sent back to its producer."""
    return spec.requires_grad and spec.dtype in _FLOATING


@dataclass(frozen=True)
class Transfer:
    """Tensor ``spec`` moves from stage ``src`` to stage ``dst``; ``tensor_id`` numbers the transfer
    (a tensor read by two stages is two transfers, so their messages never share a tag)."""

    spec: BoundaryTensor
    src: int
    dst: int
    tensor_id: int

    @property
    def grad(self) -> bool:
        return needs_grad(self.spec)

    def tag(self, microbatch: int, num_tensors: int, gradient: bool, shape: bool = False) -> int:
        """A message tag unique per (microbatch, tensor, direction) so messages cannot be confused;
        ``shape``: the tag of the message that carries a data-dependent tensor's shape ahead of it
        (Note [data-dependent messages] in ``fxpipe.runtime.pipeline.stage_io``)."""
        return (
            ((microbatch * num_tensors + self.tensor_id) << 2) | (int(shape) << 1) | int(gradient)
        )


@dataclass(frozen=True)
class Routes:
    """All transfers of a build, and where each stage input and model output comes from."""

    num_stages: int
    transfers: tuple[Transfer, ...]
    model_outputs: tuple[str, ...]
    input_names: tuple[str, ...]
    num_tensors: int  # transfers, for message tags

    @property
    def loss_stage(self) -> int:
        return self.num_stages - 1

    def recvs(self, stage: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.dst == stage)

    def sends(self, stage: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.src == stage)

    def links(self) -> tuple[Link, ...]:
        """Stage-to-stage links for the schedule validator (one per connected pair)."""
        grad: dict[tuple[int, int], bool] = {}
        for t in self.transfers:
            grad[(t.src, t.dst)] = grad.get((t.src, t.dst), False) or t.grad
        return tuple(Link(s, d, g) for (s, d), g in sorted(grad.items()))


def routes_from_manifest(manifest: Manifest) -> Routes:
    """Derive the transfers of ``manifest``; refuses boundaries that do not line up."""
    last = manifest.num_stages - 1
    produced: dict[str, BoundaryTensor] = {}
    for stage in manifest.stages:
        for out in stage.outputs:
            if out.producer != stage.index:
                raise BuildDirError(
                    f"manifest: stage {stage.index} lists output {out.name!r} "
                    f"whose producer is {out.producer}; rebuild the directory"
                )
            produced[out.name] = out
    input_names = tuple(t.name for t in manifest.inputs)
    pairs: list[tuple[BoundaryTensor, int]] = []
    for stage in manifest.stages:
        for inp in stage.inputs:
            if inp.producer == INPUT:
                if inp.name not in input_names:
                    raise BuildDirError(
                        f"manifest: stage {stage.index} reads model input {inp.name!r}, "
                        f"which is not among the model inputs {list(input_names)}"
                    )
                continue
            spec = produced.get(inp.name)
            if spec is None or not 0 <= inp.producer < stage.index:
                raise BuildDirError(
                    f"manifest: stage {stage.index} input {inp.name!r} comes from stage "
                    f"{inp.producer}, which does not output it before stage {stage.index}"
                )
            pairs.append((spec, stage.index))
    outputs: dict[int, str] = {}
    for spec in produced.values():
        if spec.model_output is not None:
            outputs[spec.model_output] = spec.name
            if spec.producer != last:
                pairs.append((spec, last))
    if sorted(outputs) != list(range(len(outputs))):
        raise BuildDirError(
            f"manifest: model output positions {sorted(outputs)} are not 0..{len(outputs) - 1}"
        )
    if not outputs:
        raise BuildDirError(
            "manifest: no stage output is marked as a model output (model_output), "
            "so there is nothing to compute the loss on; rebuild the directory"
        )
    unique = sorted({(spec.name, dst): spec for spec, dst in pairs}.items())
    transfers = tuple(
        Transfer(spec, spec.producer, dst, i) for i, ((_, dst), spec) in enumerate(unique)
    )
    return Routes(
        num_stages=manifest.num_stages,
        transfers=transfers,
        model_outputs=tuple(outputs[i] for i in range(len(outputs))),
        input_names=input_names,
        num_tensors=max(len(transfers), 1),
    )
