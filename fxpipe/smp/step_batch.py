"""The step's batch from the first stage's rank: every rank of a pipeline trains on one batch.

Note [one batch per pipeline]: a ``@step`` function runs on every rank of a pipeline, each with
the arguments its own script passed: the first stage feeds the model the ``data`` it got, the
last stage computes the loss with the ``target`` it got. Those are one batch only if every rank
loaded the same rows, and a standard script does not: a ``DataLoader(shuffle=True)`` without a
seeded generator draws each epoch's order from the global RNG, which dropout advances on the
ranks that hold a dropout layer only, so from the second epoch the last stage scores the first
stage's inputs against other rows' targets (silently: the loss just stops falling). So, as
SageMaker's library and Megatron's ``broadcast_data`` do, the first stage's rank holds the batch:

1. every rank describes its arguments (the pytree structure; each tensor's dtype and shape; the
   value of each ``int``/``float``/``bool``/``str``/``None``; the type of anything else, such as
   the model) and fingerprints its tensors' bytes (Note [batch fingerprint] in
   ``fxpipe.runtime.pipeline.fingerprint``); the ranks all-gather the description's 64-bit digest and
   the fingerprint over the pipeline. A difference in the description is a ``StepError`` on every
   rank naming the argument and each rank's value;
2. when the fingerprints differ, the first stage's rank broadcasts the bytes of its tensor
   arguments, packed into one buffer, and a rank whose own differed runs the step on those (and
   warns, once: its loader is not the first stage's).

Replicas of data parallelism are separate pipelines: each trains on its own first stage's batch.
With tensor parallelism a replica is T pipelines (one per tp index) that must see one batch: the
group is every rank of the replica, and tp index 0's first stage holds the batch.
Per step this costs two reductions over the tensor arguments' bytes (the fingerprint) and one
all-gather of 24 bytes per rank; only a batch that differs is sent (one broadcast of its bytes).
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from fxpipe.errors import StepError
from fxpipe.runtime.pipeline.fingerprint import fingerprint
from fxpipe.runtime.pipeline.p2p import peer_error
from fxpipe.smp.state import APIState, current

__all__ = ["first_stage_batch"]

_VALUES = (bool, int, float, complex, str, bytes, type(None))
_ALIGN = (
    16  # bytes: each tensor starts aligned in the packed buffer, so it can be viewed as its dtype
)


def _describe(leaf: Any) -> tuple[Any, ...]:
    """What must be equal on every rank of a pipeline: a tensor's dtype and shape, a plain value, an object's type."""
    if isinstance(leaf, torch.Tensor):
        return (
            "tensor",
            str(leaf.dtype).removeprefix("torch."),
            tuple(leaf.shape),
            str(leaf.layout),
        )
    if isinstance(leaf, _VALUES):
        return ("value", repr(leaf))
    return ("object", type(leaf).__qualname__)


def _shown(d: tuple[Any, ...]) -> str:
    if d[0] == "tensor":
        return f"a tensor of shape {d[2]}, {d[1]}" + (
            "" if d[3] == "torch.strided" else f" ({d[3]})"
        )
    return d[1] if d[0] == "value" else f"a {d[1]}"


def _name(path: tuple[Any, ...], params: list[str]) -> str:
    """``target``, ``batch['labels']`` or ``args[2]``: where a leaf of ``(args, kwargs)`` is."""
    if len(path) < 2:
        return "the arguments"
    if path[0].idx == 0:
        i = path[1].idx
        return (params[i] if i < len(params) else f"args[{i}]") + keystr(path[2:])
    return str(path[1].key) + keystr(path[2:])


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _digest(structure: str, described: list[tuple[Any, ...]]) -> int:
    raw = hashlib.blake2b(repr((structure, described)).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _comm_device(st: APIState, group: Any) -> torch.device:
    """Where collectives run: the rank's GPU under NCCL, else the CPU (gloo)."""
    return st.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _mismatch(
    st: APIState,
    group: Any,
    src: int,
    names: list[str],
    described: list[tuple[Any, ...]],
    structure: str,
) -> StepError:
    """The one-line error for arguments that differ across the pipeline (every rank builds the same one)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (st.rank, structure, names, described), group=group)
    ranks = {r: (s, n, d) for r, s, n, d in everyone}
    first_structure, first_names, first_described = ranks[src]
    tail = (
        f"; pass every rank of a pipeline a batch of the same structure, dtypes and shapes (rank {src}, the "
        "first stage's, feeds the pipeline its values)"
    )
    for r, (s, n, d) in sorted(ranks.items()):
        if n != first_names:
            return StepError(
                f"the @step function was called with ({', '.join(first_names)}) on rank {src} but "
                f"({', '.join(n)}) on rank {r}" + tail
            )
        if s != first_structure:
            return StepError(
                f"the @step function's arguments are nested differently on rank {src} "
                f"({first_structure}) and on rank {r} ({s})" + tail
            )
        for name, want, got in zip(first_names, first_described, d):
            if want != got:
                return StepError(
                    f"the @step function's argument {name} is {_shown(want)} on rank {src} but "
                    f"{_shown(got)} on rank {r}" + tail
                )
    return StepError("the @step function's arguments differ across the pipeline" + tail)


def first_stage_batch(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the tensors of the first stage's rank of this pipeline (Note [one batch
    per pipeline]); collective over the pipeline."""
    st = current()
    st.step_calls += 1
    if st.layout.num_stages * st.layout.tensor_parallel == 1:
        return args, kwargs
    group = st.replica_group  # every rank of the replica: its tp ranks share one batch too
    src = st.layout.rank_of(0, st.dp_rank, 0)
    flat, spec = tree_flatten_with_path((args, kwargs))
    paths, leaves = [p for p, _ in flat], [x for _, x in flat]
    described = [_describe(x) for x in leaves]
    structure = " ".join(str(spec).split())
    tensors = [
        i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.layout == torch.strided
    ]
    device = _comm_device(st, group)
    doing = "comparing the @step function's arguments across the pipeline"
    try:
        mine = torch.tensor(
            [_digest(structure, described), *fingerprint(leaves[i] for i in tensors)], device=device
        )
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        everyone = [g.tolist() for g in gathered]
        if len({g[0] for g in everyone}) > 1:
            params = _positional_names(fn)
            raise _mismatch(st, group, src, [_name(p, params) for p in paths], described, structure)
        first = everyone[dist.get_group_rank(group, src) if group is not None else src]
        if all(g == first for g in everyone):
            return args, kwargs  # one batch already: nothing to send
        sizes = [leaves[i].numel() * leaves[i].element_size() for i in tensors]
        offsets = []
        total = 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        if st.rank == src:
            for i, off, n in zip(tensors, offsets, sizes):
                buffer[off : off + n].copy_(_bytes(leaves[i]))
        doing = "receiving the step's batch from the first stage"
        dist.broadcast(buffer, src=src, group=group)
    except RuntimeError as exc:
        raise peer_error(exc, st.rank, doing, st.timeout_s) from exc
    if mine.tolist() == first:
        return args, kwargs
    for i, off, n in zip(tensors, offsets, sizes):
        own = leaves[i]
        received = buffer[off : off + n].to(own.device).view(own.dtype).view(own.shape)
        leaves[i] = received.requires_grad_(True) if own.requires_grad else received
    if not st.warned_batch:
        st.warned_batch = True
        warnings.warn(
            f"fxpipe: rank {st.rank}'s @step arguments differ from the first stage's (rank {src}) at call "
            f"{st.step_calls} of a @step function; the pipeline trains on the first stage's batch. Ranks of "
            "a pipeline load different rows when a DataLoader(shuffle=True) has no seeded generator "
            "(dropout draws random numbers on some ranks only): pass generator=torch.Generator()"
            ".manual_seed(seed) to it",
            stacklevel=3,
        )
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return tuple(new_args), dict(new_kwargs)
