"""The loss a model computes itself: what training uses when no ``loss_fn`` is given.

A Hugging Face model called with ``labels=`` returns its loss in its output
(``output.loss``); a model file without ``loss_fn`` and ``PipelineRunner(build,
loss_fn=None)`` train on it. The labels are then a model input like any other, cut into
microbatches along their batch dimension, and the loss of each microbatch is the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.errors import RuntimeSetupError

__all__ = ["model_loss"]


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """``output.loss`` (or ``output["loss"]``) of a model that computes its own loss; ``target`` is unused.

    Raises ``RuntimeSetupError`` when the output holds no loss tensor.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        kind = type(output).__name__
        raise RuntimeSetupError(
            f"no loss function was given and the model's output ({kind}) holds no loss tensor; "
            "pass the model labels= in its inputs (a model that computes its own loss returns it "
            "as output.loss), or give a loss_fn (a model file's loss_fn and example_targets)"
        )
    return loss
