"""Trace the eval mode too, with the front end and leaves the train-mode trace used, and merge it in.

See Note [both modes in one graph] in :mod:`fxpipe.tracer.train_eval.modes` and Note [aligning two traces]
in :mod:`fxpipe.tracer.train_eval.merge`. The train-mode graph stays what it was (the profile is made from
it); the eval-mode graph only adds guards and mode switches.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import TraceError
from fxpipe.tracer.train_eval.merge import MergeSummary, merge_modes
from fxpipe.tracer.train_eval.modes import run_in_mode

__all__ = ["merge_eval_mode"]


def merge_eval_mode(
    model: nn.Module,
    gm: torch.fx.GraphModule,
    inputs: tuple[torch.Tensor, ...],
    *,
    trace: Callable[[], torch.fx.GraphModule],
    run: Callable[[], Any],
    check: bool = True,
) -> MergeSummary:
    """Trace ``model`` in eval mode and merge that graph into the train-mode graph ``gm`` (in place).

    ``trace()`` traces the model in its current mode as ``gm`` was traced (same front end, same
    leaves, the fallback leaves included) and returns the normalized graph; ``run()`` calls the
    model on the example inputs, whose tensors are ``inputs``. The model is left in train mode.
    Warns when the merged graph, run in eval mode, does not give the model's own eval-mode outputs
    (``check=False``: not compared, for meta tensors that hold no values).
    """
    model.eval()
    try:
        with (
            torch.enable_grad()
        ):  # as in training: no_grad would take nn.MultiheadAttention's fast path, not traced
            expected = [
                t.detach() if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(run())
            ]
        try:
            eval_gm = trace()
        except TraceError as exc:
            raise TraceError(
                f"{type(model).__name__} traces in train mode but not in eval mode: {exc}"
            ) from exc
        summary = merge_modes(gm, eval_gm)
        with torch.no_grad():
            env = run_in_mode(gm, inputs, training=False)
    finally:
        model.train()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    got = [env[n] for n in out.args[0]]
    if check and (
        len(got) != len(expected)
        or not all(
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
            for a, b in zip(got, expected)
        )
    ):
        warnings.warn(
            "fxpipe: the traced graph's outputs in eval mode differ from the model's own; the model "
            "may depend on state the trace did not capture",
            stacklevel=3,
        )
    return summary
