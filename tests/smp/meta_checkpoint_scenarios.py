"""Rank function of the seed-API checkpoint tests on a model built on meta (importable by spawned children)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from meta_scenarios import GPT, MICROBATCHES, train

import fxpipe.smp as api
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import build_on_meta


def meta_checkpoint_job(
    rank: int, world: int, mode: str, checkpoint: str, save_to: str | None
) -> dict[str, Any]:
    """``DistributedModel`` of the GPT built on meta, its weights from ``checkpoint`` by ``mode``, then SGD.

    ``"full"``: rank 0 writes ``checkpoint`` (a ``torch.save``d state dict) as a full ``smp.save`` checkpoint,
    every rank ``smp.load``s it; ``"partial"``: ``smp.load(partial=True)`` of parts ``smp.save`` wrote;
    ``"config"``: the config's ``weights`` names the checkpoint. With ``save_to``, the trained stages are
    saved there as a partial checkpoint and the gathered full state dict is returned.
    """
    warnings.filterwarnings("ignore")
    source = load_model_file(GPT)
    config: dict[str, Any] = {"partitions": 2, "microbatches": MICROBATCHES}
    if mode == "config":
        config["weights"] = checkpoint
    api.init(config)
    model = api.DistributedModel(build_on_meta(source.build_model))
    if mode == "full":
        full = f"{checkpoint}.smp"
        api.save(
            {"model": torch.load(checkpoint, weights_only=True)}, full, partial=False
        )  # rank 0 writes
        dist.barrier()
        model.load_state_dict(api.load(full, partial=False)["model"])
    elif mode == "partial":
        model.load_state_dict(api.load(checkpoint, partial=True)["model"])
    out = train(model, source)
    if save_to is not None:
        api.save({"model": model.local_state_dict()}, save_to, partial=True)
        out["full"] = model.state_dict()
    return out


def repartition_job(rank: int, world: int, start: str, full: str) -> dict[str, Any]:
    """``DistributedModel`` of the GPT on ``world`` partitions: rank 0 writes the ``torch.save``d state
    dict ``start`` (when given) as a full ``smp.save`` checkpoint ``full``, every rank
    ``smp.load``s it, trains; then the trained model is saved as the full checkpoint
    ``full + ".next"`` (what another partition count loads next)."""
    warnings.filterwarnings("ignore")
    source = load_model_file(GPT)
    api.init({"partitions": world, "microbatches": MICROBATCHES})
    model = api.DistributedModel(build_on_meta(source.build_model))
    if start:  # every rank calls save (rank 0 writes), as the other full-checkpoint job does
        api.save({"model": torch.load(start, weights_only=True)}, full, partial=False)
        if world > 1:
            dist.barrier()
    model.load_state_dict(api.load(full, partial=False)["model"])
    out = train(model, source)
    state = model.state_dict()
    api.save({"model": state}, f"{full}.next", partial=False)
    out["full"] = state
    return out
