"""Shape formulas: a tensor's dimensions as expressions of the step's dynamic sizes.

Note [shape formulas]: a build may keep several input dimensions dynamic (the batch, always,
as the symbol ``mb``: the microbatch a stage runs on; others declared by the model file, such as
``seq``). Every traced tensor then records, per dimension, a formula in those symbols: ``"mb"``,
``"seq"``, ``"mb*seq"``, ``"2*seq+1"`` or a constant ``"32"``. The tracer fits the formulas from
runs of the graph at a few sizes (:func:`fit_dim`), the manifest carries them for every boundary
tensor, and the runtime sizes its receive buffers by evaluating them (:func:`evaluate`) at the
sizes it reads off the step's model inputs (:func:`bind_symbols`), on every rank, with no
message. A dimension no formula fits (one that depends on the data) has the formula ``"?"``:
its tensor's shape travels with it. A symbol's ``DimRange`` is the range the trace holds for;
a size outside it is refused before any kernel runs.

The language is tiny and evaluated without ``eval``: integers, symbols, ``+``, ``-``, ``*``
and ``//``.

>>> evaluate("2*seq+1", {"seq": 8})
17
>>> fit_dim(32, {"mb": (2, 4, 64), "seq": (16, 32, 64)}, {"mb": 2, "seq": 16}, 128)
'mb*seq'
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxpipe.errors import FxpipeError

__all__ = [
    "BATCH",
    "UNKNOWN",
    "DimRange",
    "ShapeError",
    "bind_symbols",
    "check_ranges",
    "evaluate",
    "fit_dim",
    "symbols_of",
]

BATCH = "mb"  # the symbol of the batch dimension (the microbatch a stage runs on)
UNKNOWN = "?"  # a dimension that depends on the data: its shape is sent with the tensor


class ShapeError(FxpipeError):
    """A step's sizes do not fit the build's dynamic dimensions."""


@dataclass(frozen=True)
class DimRange:
    """A dynamic dimension: its symbol, the sizes the build holds for (``max`` None: no bound) and the
    size it was traced at."""

    name: str
    min: int
    max: int | None
    traced: int

    def holds(self, size: int) -> bool:
        return self.min <= size and (self.max is None or size <= self.max)

    def shown(self) -> str:
        return f"{self.min}..{'' if self.max is None else self.max}"


_OPS = {
    ast.Add: int.__add__,
    ast.Sub: int.__sub__,
    ast.Mult: int.__mul__,
    ast.FloorDiv: int.__floordiv__,
}


def _eval(node: ast.AST, sizes: Mapping[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in sizes:
            raise KeyError(node.id)
        return int(sizes[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left, sizes), _eval(node.right, sizes))
    raise ValueError(f"not a shape formula: {ast.dump(node)}")


def evaluate(formula: str, sizes: Mapping[str, int]) -> int:
    """The value of ``formula`` at ``sizes`` (symbol -> size). Raises ``KeyError`` for an unbound symbol,
    ``ValueError`` for ``"?"`` or anything outside the formula language."""
    if formula == UNKNOWN:
        raise ValueError("the dimension depends on the data")
    return _eval(ast.parse(formula, mode="eval").body, sizes)


def symbols_of(formula: str) -> set[str]:
    """The symbols ``formula`` reads."""
    if formula == UNKNOWN:
        return set()
    return {n.id for n in ast.walk(ast.parse(formula, mode="eval")) if isinstance(n, ast.Name)}


def _term(coefficient: int, names: Sequence[str]) -> str:
    product = "*".join(names)
    if not names:
        return str(coefficient)
    return product if coefficient == 1 else f"{coefficient}*{product}"


def fit_dim(
    base: int,
    probes: Mapping[str, tuple[int, int, int]],
    traced: Mapping[str, int],
    together: int | None,
) -> str:
    """The formula of one dimension, from its size ``base`` at the traced sizes, ``probes[s] = (traced
    value of s, probe value of s, the dimension's size when only s took the probe value)`` and its size
    ``together`` when every symbol took its probe value at once (``None``: that run failed). Fits
    ``c * s1 * s2 ...`` (``c`` an integer, or ``s // q``) or ``a * s + b`` in one symbol; ``"?"`` when
    neither fits or the run with every probe disagrees."""
    moved = {s: p for s, p in probes.items() if p[2] != base}
    if not moved:
        formula = str(base)
    else:
        formula = _monomial(base, moved) or _affine(base, moved) or UNKNOWN
    if formula != UNKNOWN and together is not None:
        if evaluate(formula, {s: p[1] for s, p in probes.items()}) != together:
            return UNKNOWN
    if formula != UNKNOWN and evaluate(formula, dict(traced)) != base:
        return UNKNOWN
    return formula


def _monomial(base: int, moved: Mapping[str, tuple[int, int, int]]) -> str | None:
    for v, probe, size in moved.values():
        if size * v != base * probe:  # proportional to this symbol
            return None
    names = sorted(moved, key=lambda s: (s != BATCH, s))
    product = math.prod(moved[s][0] for s in names)
    if base % product == 0:
        return _term(base // product, names)
    if len(names) == 1 and product % base == 0:
        return f"{names[0]}//{product // base}"
    return None


def _affine(base: int, moved: Mapping[str, tuple[int, int, int]]) -> str | None:
    if len(moved) != 1:
        return None
    ((name, (v, probe, size)),) = moved.items()
    slope, rem = divmod(size - base, probe - v)
    if rem or slope == 0:
        return None
    offset = base - slope * v
    term = _term(slope, [name])
    return term if offset == 0 else f"{term}{'+' if offset > 0 else '-'}{abs(offset)}"


def bind_symbols(
    shapes: Sequence[tuple[int, ...]], formulas: Sequence[Sequence[str] | None], where: str
) -> dict[str, int]:
    """The symbols' sizes read off tensors (``shapes``) whose dimensions have ``formulas``: each dimension
    whose formula is a bare symbol binds it. Two tensors that disagree on a symbol raise ``ShapeError``."""
    sizes: dict[str, int] = {}
    for shape, dims in zip(shapes, formulas):
        if dims is None:
            continue
        for size, formula in zip(shape, dims):
            if formula.isidentifier():
                seen = sizes.setdefault(formula, int(size))
                if seen != size:
                    raise ShapeError(
                        f"{where}: dimension {formula!r} is {seen} in one input and {size} in another; "
                        "the inputs of one step must agree on it"
                    )
    return sizes


def check_ranges(sizes: Mapping[str, int], ranges: Sequence[DimRange], where: str) -> None:
    """Refuse sizes outside the ranges the build was traced for (before any message or kernel)."""
    for r in ranges:
        size = sizes.get(r.name)
        if size is not None and not r.holds(size):
            raise ShapeError(
                f"{where}: {r.name} = {size} is outside the range {r.shown()} the build was traced for "
                f"(at {r.name} = {r.traced}); partition again with a dynamic_dims() range that holds it"
            )
