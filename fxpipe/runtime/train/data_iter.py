"""Training and evaluation batches from a model file's generator functions, one replica's shard per rank.

A model file may define ``train_batches(batch_size, rank_info)`` and ``eval_batches(batch_size,
rank_info)``; ``--data path.py:function`` / ``--eval-data`` name others. Each yields
``(inputs, targets)`` for ONE replica's batch of ``batch_size`` samples: ``inputs`` as
``example_inputs`` returns them (a tensor, a tuple, a dict of keyword arguments, or
``(args, kwargs)``), ``targets`` for the loss function (anything, or ``None`` for a model
that computes its own loss). ``rank_info`` (a ``RankInfo``) says which replica's shard to
yield and what this rank needs: a rank whose stages read no model input may yield
``None`` inputs (it gets zero-cost placeholders of the right shape), a rank without the
loss may yield ``None`` targets, so only the ranks that need a batch's tensors read them.

The ranks of one replica must yield the same batches (``rank_info.stage`` may only decide what
to leave out): each step compares what they yielded (Note [one batch per pipeline under fxpipe
run] in ``fxpipe.runtime.train.batch_check``).

Note [data position]: a generator is restarted when it ends (a new epoch) and must yield
the same batches each time it is called with the same arguments (seed it from
``rank_info.replica``). The position of a run in it is the number of batches drawn;
a resumed run calls the function again and skips that many, so it sees the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpipe.codegen.manifest import INPUT, Manifest
from fxpipe.errors import ModelFileError
from fxpipe.modelfile import ModelSource, import_model_module
from fxpipe.runtime.pipeline.stage_io import boundary_dtype
from fxpipe.tracer.call import ModelInputs

__all__ = [
    "RankInfo",
    "BatchFn",
    "Batch",
    "Placeholders",
    "placeholders",
    "find_batches",
    "batch_stream",
    "rank_needs_inputs",
    "TRAIN_FN",
    "EVAL_FN",
]

TRAIN_FN, EVAL_FN = "train_batches", "eval_batches"
Batch = tuple[tuple[torch.Tensor, ...], Any]


@dataclass(frozen=True)
class RankInfo:
    """What a batch function is told about the rank calling it.

    ``replica`` of ``replicas`` picks the shard; ``stage`` of ``num_stages`` is the rank's
    place in its pipeline; ``needs_inputs`` / ``needs_targets`` say whether this rank reads
    the model inputs / targets (else it may yield ``None`` for them).
    """

    rank: int
    world_size: int
    stage: int
    num_stages: int
    replica: int
    replicas: int
    needs_inputs: bool
    needs_targets: bool


BatchFn = Callable[[int, RankInfo], Any]


def rank_needs_inputs(manifest: Manifest, stages: list[int]) -> bool:
    """Whether any of ``stages`` reads a model input."""
    return any(i.producer == INPUT for s in stages for i in manifest.stage(s).inputs)


def find_batches(source: ModelSource | None, spec: str | None, default: str) -> BatchFn | None:
    """The batch function ``spec`` names (``path.py:function``), else the model file's ``default``
    function, else ``None``."""
    if spec is not None:
        path, _, name = spec.rpartition(":")
        if not Path(path).is_file():
            raise ModelFileError(f"data file {path!r} (of {spec!r}) does not exist")
        fn = getattr(import_model_module(path), name, None)
        if not callable(fn):
            raise ModelFileError(
                f"{Path(path).name} defines no function {name}(batch_size, rank_info)"
            )
        return fn
    if source is not None and source.has(default):
        return getattr(source.module, default)
    return None


class Placeholders(tuple):
    """Model inputs of a rank that yielded none: shapes only, no data (not compared across ranks)."""


def placeholders(
    manifest: Manifest, batch_size: int, sizes: Mapping[str, int] | None = None
) -> Placeholders:
    """Model inputs of the right shapes that own no memory (a rank that reads none only needs their sizes).

    ``sizes``: the step's dynamic sizes (Note [shape formulas] in ``fxpipe.shapeformula``), the traced
    ones until the ranks that drew the batch tell them (``fxpipe.runtime.train.batch_check``)."""
    if sizes is None:
        sizes = {r.name: r.traced for r in manifest.dynamic}
    out = []
    for spec in manifest.inputs:
        dtype = boundary_dtype(spec.dtype)
        shape = (
            spec.shape_at(batch_size, manifest.microbatch_size, sizes)
            if spec.batch_dim is not None or spec.dims is not None
            else spec.shape
        )
        out.append(torch.zeros((), dtype=dtype).expand(shape))
    return Placeholders(out)


def _bind(manifest: Manifest, item: Any, info: RankInfo, batch_size: int, where: str) -> Batch:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ModelFileError(
            f"{where} yielded {type(item).__name__}; yield (inputs, targets) pairs"
        )
    inputs, targets = item
    if inputs is None:
        if info.needs_inputs:
            raise ModelFileError(
                f"{where} yielded no inputs on rank {info.rank}, whose stage reads model inputs "
                "(rank_info.needs_inputs)"
            )
        return placeholders(manifest, batch_size), targets
    try:
        call = inputs if isinstance(inputs, (ModelInputs, Mapping, torch.Tensor)) else tuple(inputs)
        return manifest.call_spec.bind_any(call), targets
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{where} yielded inputs the model cannot take: {exc}") from None


def batch_stream(
    fn: BatchFn,
    manifest: Manifest,
    batch_size: int,
    info: RankInfo,
    start: int = 0,
    name: str = TRAIN_FN,
) -> Iterator[Batch]:
    """The batches of ``fn(batch_size, info)`` bound to the build's tensor inputs, endlessly (restarted
    at each end), from position ``start`` on (Note [data position])."""
    where = f"{getattr(fn, '__name__', name)}({batch_size}, rank_info)"
    position = 0
    while True:
        empty = True
        for item in fn(batch_size, info):
            empty = False
            if position >= start:
                yield _bind(manifest, item, info, batch_size, where)
            position += 1
        if empty:
            raise ModelFileError(f"{where} yielded no batches")
