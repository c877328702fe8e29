"""Rank function of the seed-API test on a model built on the meta device (importable by spawned children)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import fxpipe.smp as api
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import build_on_meta

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
STEPS, BATCH, MICROBATCHES, LR = 3, 8, 2, 0.1


def meta_training_job(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    """``DistributedModel`` of the GPT built on meta, then ``load_state_dict`` of a full checkpoint, then SGD."""
    warnings.filterwarnings("ignore")
    source = load_model_file(GPT)
    api.init({"partitions": 2, "microbatches": MICROBATCHES})
    model = api.DistributedModel(build_on_meta(source.build_model))
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    return train(model, source)


def train(model: Any, source: Any) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``model`` (a ``DistributedModel``); the losses, this rank's stage and its meta keys."""
    opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @api.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = source.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(
            train_step(model, *source.example_inputs(BATCH), source.example_targets(BATCH))
            .reduce_mean()
            .item()
        )
        opt.step()
    local = {
        k: v.detach().clone()
        for k, v in model.local_state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    return {
        "losses": losses,
        "local": local,
        "meta": [k for k, v in model.module.state_dict().items() if v.is_meta],
    }
