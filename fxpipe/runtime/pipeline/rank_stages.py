"""The stages one pipeline rank holds: loaded one by one, tied parameters shared, seen as one module.

A build made with ``--virtual-stages V`` gives each rank V stages (chunks,
``Manifest.stage_ranks``); a rank loads only its own. Each stage file carries its own
copy of a tied parameter (GPT's embedding and output projection), so when two of them
sit on one rank they are made to share one ``nn.Parameter``: autograd then sums its
gradient in ``.grad`` by itself, the optimizer and DDP see it once, and only ties
spanning ranks need an all-reduce (``fxpipe.runtime.pipeline.groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError

__all__ = ["load_rank_stages", "share_tied_parameters", "rank_module", "rank_state_dict"]


def load_rank_stages(
    manifest: Manifest,
    rank: int,
    load: Callable[[int, torch.device], nn.Module],
    device: torch.device,
) -> dict[int, nn.Module]:
    """Stage index -> module of every stage pipeline rank ``rank`` runs, ties shared."""
    modules = {s: load(s, device) for s, r in enumerate(manifest.stage_ranks) if r == rank}
    if not modules:
        raise BuildDirError(
            f"pipeline rank {rank} runs no stage of this build (its stages run on ranks "
            f"{sorted(set(manifest.stage_ranks))}); launch {manifest.num_ranks} processes per replica"
        )
    share_tied_parameters(modules, manifest)
    return modules


def share_tied_parameters(modules: Mapping[int, nn.Module], manifest: Manifest) -> None:
    """Make the stages in ``modules`` that hold the same tied parameter hold one ``nn.Parameter``.

    Note [ties under tensor parallelism]: ``parallelize_module`` gives each stage its own DTensor
    of a parameter it splits, so a parameter two chunks of one rank shared before is two after;
    the runtime calls this again once the stages are split. The tensor-parallel plan splits a tie
    on every stage alike or on none (Note [vocabulary-parallel] in ``fxpipe.codegen.tp_plan``), so
    the copies have the same placements and values, and one of them serves every chunk."""
    for tie in manifest.ties:
        here = [(s, k) for s, k in zip(tie.stages, tie.keys) if s in modules]
        if len(here) < 2:
            continue
        first_stage, first_key = here[0]
        shared = modules[first_stage].get_parameter(first_key)
        for s, key in here[1:]:
            owner_path, _, name = key.rpartition(".")
            owner = modules[s].get_submodule(owner_path) if owner_path else modules[s]
            mine = owner._parameters.get(name)
            if mine is None:
                raise BuildDirError(
                    f"the manifest ties {key!r} on stage {s}, which has no such parameter; "
                    "rebuild the directory"
                )
            if mine.shape != shared.shape:
                raise BuildDirError(
                    f"tied parameter {key!r} has shape {tuple(mine.shape)} on stage {s} but "
                    f"{tuple(shared.shape)} on stage {first_stage}; rebuild the directory"
                )
            placements = [getattr(p, "placements", None) for p in (mine, shared)]
            if placements[0] != placements[1]:
                raise BuildDirError(
                    f"tied parameter {key!r} is split as {placements[0]} on stage {s} but "
                    f"{placements[1]} on stage {first_stage}; a tensor-parallel plan must split "
                    "a tie on every stage alike (edit tp_plan.json or rebuild)"
                )
            owner._parameters[name] = shared


def rank_module(modules: Mapping[int, nn.Module]) -> nn.Module:
    """The rank's stages as one module (for the optimizer, DDP and memory tracking): the stage
    itself when there is one, else a ``ModuleList`` in stage order (shared parameters listed once)."""
    if len(modules) == 1:
        return next(iter(modules.values()))
    return nn.ModuleList([modules[s] for s in sorted(modules)])


def rank_state_dict(modules: Mapping[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The union of the stages' state dicts, under the original model's keys."""
    out: dict[str, torch.Tensor] = {}
    for s in sorted(modules):
        out.update(modules[s].state_dict())
    return out
