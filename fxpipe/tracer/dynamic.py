"""Dynamic dimensions of the traced call: which input dimensions follow the data, and their ranges.

Note [dynamic dimensions]: the batch dimension of every batched input is always dynamic (the symbol
``mb``, Note [shape formulas] in :mod:`fxpipe.shapeformula`). Other dimensions become dynamic when
the model file declares them::

    def dynamic_dims():
        return {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}  # or {1: ("seq", 2, 512)}

(keyed by the forward's parameter names; a value is a symbol, ``(symbol, min, max)`` or a
``torch.export.Dim``), or when ``--dynamic auto`` asks the tracer to find them: every non-batch
dimension of every input is offered to ``torch.export`` as ``Dim.AUTO``, and the dimensions it
kept symbolic (the ones the model does not specialise) are the dynamic ones, each input's own
symbol unless export found two equal. Export traces with the declared ``Dim`` s, so a model that
specialises a declared dimension (a constant it reads from it, a guard it fails) is refused
with torch.export's own account of the place and the range that holds. Both front ends then
run the graph at the traced sizes and at probe sizes (:func:`probe_inputs`) and fit each
tensor's shape formula (``fxpipe.tracer.measure.shapes``); a symbolic graph that baked a size fails the
probe run, which names the node.

Note [guards export cannot prove]: a guard that holds over the whole declared range but that
``torch.export``'s symbolic reasoning cannot prove (transformers' ViT with
``interpolate_pos_encoding=True`` leaves ``(side // 8) % (side // 8)**2 != 0``) is not a
specialisation. On such a refusal only (``unproven_guard``: "Not all values ... satisfy the
generated guard"), the export runs again with ``prefer_deferred_runtime_asserts_over_guards``: the
guard becomes a run-time assert in the graph, so a stage checks it on every call, and the trace
says which guard (``deferred_guard_note``). A dimension the model really fixes (two sizes that
must be equal, a size it reads as a constant) is still refused with its one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.export import Dim

from fxpipe.errors import TraceError
from fxpipe.shapeformula import BATCH, DimRange

__all__ = [
    "DynamicDims",
    "SpecialisedError",
    "export_dims",
    "probe_inputs",
    "probe_size",
    "ranges_of",
    "resolve_dynamic_dims",
    "specialised_error",
]


class SpecialisedError(TraceError):
    """The model specialises a dimension the model file declared dynamic."""


# per tensor input: dimension -> (symbol, min, max); the batch dimension is not listed
DynamicDims = tuple[dict[int, tuple[str, int, int | None]], ...]


def _declared(value: Any, where: str) -> tuple[str, int, int | None]:
    if isinstance(value, str):
        return value, 2, None
    if isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[0], str):
        name, low, high = value
        return name, int(low), None if high is None else int(high)
    name = getattr(value, "__name__", None)
    if name is not None and hasattr(value, "min") and hasattr(value, "max"):  # torch.export.Dim
        high = int(value.max)
        return name, int(value.min), None if high >= 2**62 else high
    raise TraceError(
        f"dynamic_dims(): {where} is {value!r}; give a symbol name, (name, min, max) or a torch.export.Dim"
    )


def resolve_dynamic_dims(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    batch_dims: Sequence[int | None],
    declared: Mapping[str, Mapping[int, Any]] | None,
) -> DynamicDims:
    """The declared dimensions, one mapping per tensor input (``names`` are the inputs' parameter names)."""
    if not declared:
        return tuple({} for _ in tensors)
    unknown = sorted(set(declared) - set(names))
    if unknown:
        raise TraceError(
            f"dynamic_dims() names {unknown}, which are not tensor inputs of the traced call; "
            f"its tensor inputs are {list(names)}"
        )
    out: list[dict[int, tuple[str, int, int | None]]] = []
    for name, t, batch in zip(names, tensors, batch_dims):
        dims: dict[int, tuple[str, int, int | None]] = {}
        for d, value in (declared.get(name) or {}).items():
            if not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise TraceError(
                    f"dynamic_dims(): {name!r} has no dimension {d!r} (shape {list(t.shape)})"
                )
            d %= t.dim()
            declared_dim = _declared(value, f"{name}[{d}]")
            if d == batch:
                continue  # the batch is dynamic anyway
            symbol, low, high = declared_dim
            if symbol == BATCH:
                raise TraceError(
                    f"dynamic_dims(): {BATCH!r} is the batch's symbol; name {name}[{d}] otherwise"
                )
            if not (low <= t.shape[d] and (high is None or t.shape[d] <= high)):
                raise TraceError(
                    f"dynamic_dims(): {name}[{d}] is {t.shape[d]} in the example inputs, outside its range "
                    f"{low}..{high or ''}"
                )
            dims[d] = declared_dim
        out.append(dims)
    by_symbol: dict[str, tuple[int, int | None, int]] = {}
    for t, dims in zip(tensors, out):
        for d, (name, low, high) in dims.items():
            seen = by_symbol.setdefault(name, (low, high, int(t.shape[d])))
            if seen[2] != t.shape[d]:
                raise TraceError(
                    f"dynamic_dims(): {name!r} is {seen[2]} in one example input and {t.shape[d]} in another"
                )
    return tuple(out)


def export_dims(
    batch_dims: Sequence[int | None], dynamic: DynamicDims, batch_min: int = 1
) -> list[dict[int, Any] | None]:
    """``torch.export``'s dynamic shapes, one mapping per tensor input (one ``Dim`` object per symbol)."""
    dims: dict[str, Any] = {BATCH: Dim("batch", min=batch_min)}
    out: list[dict[int, Any] | None] = []
    for batch, extra in zip(batch_dims, dynamic):
        shape: dict[int, Any] = {} if batch is None else {batch: dims[BATCH]}
        for d, (symbol, low, high) in extra.items():
            if symbol not in dims:
                dims[symbol] = (
                    Dim(symbol, min=low, max=high) if high is not None else Dim(symbol, min=low)
                )
            shape[d] = dims[symbol]
        out.append(shape or None)
    return out


def ranges_of(
    tensors: Sequence[torch.Tensor],
    dynamic: DynamicDims,
    exported: Mapping[str, tuple[int, int | None]],
) -> tuple[DimRange, ...]:
    """Each declared symbol's range: the declared one, narrowed to what export found (``exported``)."""
    seen: dict[str, DimRange] = {}
    for t, dims in zip(tensors, dynamic):
        for d, (symbol, low, high) in dims.items():
            if symbol in seen:
                continue
            e_low, e_high = exported.get(symbol, (low, high))
            low = max(low, e_low)
            high = e_high if high is None else (high if e_high is None else min(high, e_high))
            seen[symbol] = DimRange(symbol, low, high, int(t.shape[d]))
    return tuple(seen.values())


def probe_size(r: DimRange) -> int:
    """A second size to run the graph at, inside ``r``: twice the traced size, else the other end."""
    twice = 2 * r.traced
    if r.max is None or twice <= r.max:
        return twice
    return r.max if r.max != r.traced else max(r.min, r.traced - 1)


def _resize(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    repeats = -(-size // max(t.shape[dim], 1))
    grown = torch.cat([t] * repeats, dim) if repeats > 1 else t
    return grown.narrow(dim, 0, size).contiguous()


def probe_inputs(
    inputs: Sequence[torch.Tensor], dynamic: DynamicDims, sizes: Mapping[str, int]
) -> tuple[torch.Tensor, ...]:
    """The inputs with each dimension of a symbol in ``sizes`` resized to it (the data repeated, or cut)."""
    out = []
    for t, dims in zip(inputs, dynamic):
        for d, (symbol, _, _) in dims.items():
            if symbol in sizes:
                t = _resize(t, d, sizes[symbol])
        out.append(t)
    return tuple(out)


_VIOLATION = re.compile(r"^\s*- (.*)$", re.M)
_FIXES = re.compile(r"Suggested fixes:\n((?:[ \t]+\S.*\n?)+)")


_UNPROVEN = re.compile(r"satisfy the generated guard ([^\n]*?)(?:\.|$)", re.M)


def unproven_guard(exc: BaseException) -> bool:
    """Whether ``torch.export`` stopped at a guard it could not prove over a declared range, not
    at a dimension the model fixes (Note [guards export cannot prove])."""
    return _UNPROVEN.search(str(exc)) is not None


def deferred_guard_note(exc: BaseException) -> str:
    """One line for the trace's log: which guard became a run-time assert."""
    match = _UNPROVEN.search(str(exc))
    guard = " ".join(match.group(1).split()) if match else "a guard"
    return (
        f"torch.export could not prove {guard} over the declared range of a dynamic dimension; "
        "traced again with it kept as a run-time assert in the stages"
    )


def specialised_error(exc: BaseException, dynamic: DynamicDims) -> SpecialisedError | None:
    """One line for torch.export's error when the model specialises a declared dimension, else ``None``:
    torch.export's own account of the guard (where the model reads the size), and its suggested range."""
    text = str(exc)
    symbols = sorted({s for dims in dynamic for s, _, _ in dims.values()})
    if not symbols or "Constraints violated" not in text and "specialized" not in text:
        return None
    violations = [" ".join(v.split()) for v in _VIOLATION.findall(text)]
    what = violations[0] if violations else text.strip().splitlines()[0]
    what = what.split(" If you're using")[0].rstrip(".")
    fixes = _FIXES.search(text)
    holds = "; ".join(line.strip() for line in fixes.group(1).splitlines()) if fixes else ""
    return SpecialisedError(
        f"the model specialises the dynamic dimension {', '.join(symbols)}: {what}"
        + (f"; what holds: {holds}" if holds else "")
        + "; declare that range in dynamic_dims() (e.g. (name, min, max)), or leave the dimension static"
    )
