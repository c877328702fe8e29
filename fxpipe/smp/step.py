"""``@step`` and ``StepOutput``: a training step written for one microbatch, run for all of them.

The decorated function is called once per microbatch with its arguments cut along
dim 0, tensors inside lists and dicts included (a batch dict for ``model(**batch)``);
tensors without a batch dim and other objects are passed whole. The tensors are those of the
pipeline's first stage's rank on every rank (Note [one batch per pipeline] in
``fxpipe.smp.step_batch``). Its return
values come back as ``StepOutput``s holding the per-microbatch values of the *last*
stage, which computes the real outputs and loss, broadcast to every rank of the
pipeline (other stages only see placeholders; see ``fxpipe.smp.driver``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fxpipe.errors import ConfigError
from fxpipe.runtime.pipeline.microbatch import split_targets
from fxpipe.smp.chunks import run_chunked_step
from fxpipe.smp.state import current
from fxpipe.smp.step_batch import first_stage_batch

__all__ = ["step", "StepOutput"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class StepOutput:
    """One returned value of a ``@step`` function, for every microbatch (``outputs[m]``)."""

    outputs: tuple[Any, ...]

    def __iter__(self) -> Iterator[Any]:
        """The per-microbatch values (so ``sum(loss_mb)`` works on numbers, as in the seed's examples)."""
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, microbatch: int) -> Any:
        return self.outputs[microbatch]

    def _tensors(self, what: str) -> list[torch.Tensor]:
        if not all(isinstance(o, torch.Tensor) for o in self.outputs):
            raise TypeError(
                f"StepOutput.{what}() needs tensors, but the step returned "
                f"{sorted({type(o).__name__ for o in self.outputs})}; use .outputs"
            )
        return list(self.outputs)

    def stack(self) -> torch.Tensor:
        """The microbatch values stacked on a new dim 0."""
        return torch.stack(self._tensors("stack"))

    def concat(self) -> torch.Tensor:
        """The microbatch values concatenated on dim 0 (e.g. predictions for the whole batch)."""
        return torch.cat(self._tensors("concat"))

    def reduce_mean(self) -> torch.Tensor:
        """The mean over microbatches (e.g. the batch loss of a mean-reduced loss)."""
        return self.stack().mean(0)

    def reduce_sum(self) -> torch.Tensor:
        """The sum over microbatches."""
        return self.stack().sum(0)


def _detach(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _share_results(results: list[Any]) -> list[Any]:
    """The last stage's per-microbatch results, on every rank of the pipeline."""
    st = current()
    if st.layout.num_stages * st.layout.tensor_parallel == 1:
        return results
    manifest = st.model.manifest if st.model is not None and st.model.partitioned else None
    loss_rank = (
        manifest.stage_ranks[-1] if manifest is not None else st.layout.num_stages - 1
    )  # the last stage's, of tp index 0: every rank of the replica gets its results
    src = st.layout.rank_of(loss_rank, st.dp_rank, 0)
    box: list[Any] = [[tree_map(_detach, r) for r in results] if st.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=st.replica_group)
    device = st.device
    return [
        tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, r) for r in box[0]
    ]


def _wrap(results: list[Any]) -> Any:
    first = results[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(StepOutput(tuple(r[i] for r in results)) for i in range(len(first)))
    return StepOutput(tuple(results))


def step(fn: F) -> F:
    """Decorate a function that runs the model and its backward on one microbatch.

    Example::

        @fxpipe.step
        def train_step(model, data, target):
            output = model(data)
            loss = F.nll_loss(output, target)
            model.backward(loss)
            return output, loss

        output_mb, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()

        @fxpipe.step
        def hf_step(model, batch):          # batch = {"input_ids": ..., "attention_mask": ..., "labels": ...}
            out = model(**batch)            # the model computes its loss from labels=
            model.backward(out.loss)
            return out.loss
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = current()
        model = st.model
        if model is None:
            raise ConfigError(
                "a @step function was called before any DistributedModel exists; wrap the model "
                "first: model = fxpipe.DistributedModel(model)"
            )
        M = st.config.microbatches
        args, kwargs = first_stage_batch(fn, args, kwargs)  # Note [one batch per pipeline]
        per_mb = split_targets((args, kwargs), M, setting="'microbatches' in fxpipe.init's config")
        model._begin_step()
        results = []
        try:
            if (
                st.config.chunks_per_rank > 1
            ):  # Note [chunked schedules in the seed API] in fxpipe.smp.chunks
                results = run_chunked_step(model, fn, per_mb)
            for m, (a, k) in enumerate(per_mb if not results else ()):
                model._set_microbatch(m)
                results.append(fn(*a, **k))
                model._set_microbatch(None)
        except BaseException:
            model._abort_step()
            raise
        model._end_step()
        return _wrap(_share_results(results))

    return wrapper  # type: ignore[return-value]
