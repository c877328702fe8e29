"""How each unit's costs follow the dynamic sizes: fitted once at trace time, so that the planner
can price the profile at another sequence length without tracing again.

Note [costs at other sizes]: a profile is traced at one size of each dynamic symbol (``seq``).
Its tensors' shapes carry formulas (Note [shape formulas]), but a unit's FLOPs do not follow its
output's shape: ``softmax(q @ k.T) @ v`` returns ``[mb, h, seq, d]`` for ``2*mb*h*seq*seq*d``
FLOPs. So the tracer counts every unit again at a few other sizes (:func:`fit_sizes`: two more
per symbol, one more per pair of symbols, inside the traced ranges) and fits, per unit, each
count (forward and backward FLOPs, the input gradients' FLOPs, the bytes the forward moves, the
activation bytes) as a polynomial of degree at most 2 in the symbols: ``1``, ``seq``,
``seq*seq`` (attention's scores), ``seq*tgt`` (cross-attention). The fit is exact wherever the
count is such a polynomial, which a transformer's are (products of dimensions, each linear in a
symbol, at most two of them a sequence length); the batch stays at the traced microbatch (the
planner prices one microbatch). ``Unit.scaling`` records the polynomials and the fixed per-op
milliseconds of the analytic estimate; ``fxpipe.partitioner.seqlen`` evaluates them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from fxpipe.shapeformula import DimRange
from fxpipe.tracer.measure.calibration import DevicePreset
from fxpipe.tracer.measure.counting import UnitCounts, count_unit, count_units_once
from fxpipe.tracer.dynamic import DynamicDims, probe_inputs, probe_size
from fxpipe.tracer.profile import Polynomial, UnitScaling
from fxpipe.tracer.measure.shapes import train_values
from fxpipe.tracer.measure.timing import ops_s
from fxpipe.tracer.measure.unit_runner import UnitRunner
from fxpipe.tracer.units import UnitGroup

__all__ = ["fit_sizes", "monomials", "fit_polynomial", "unit_scalings"]


def _other_sizes(r: DimRange) -> list[int]:
    """Two sizes of ``r`` besides the traced one: the probe size and one more, inside the range."""
    first = probe_size(r)
    out = [first]
    for candidate in (3 * r.traced, r.traced + first, r.traced // 2, r.max, r.min, r.traced + 1):
        if candidate is None or candidate in out or candidate == r.traced:
            continue
        if r.holds(candidate) and candidate > 0:
            out.append(candidate)
            break
    return out


def fit_sizes(ranges: Sequence[DimRange]) -> list[dict[str, int]]:
    """The sizes to count the units at besides the traced ones: each symbol at two other sizes (the
    rest traced), each pair of symbols at their probe sizes together."""
    traced = {r.name: r.traced for r in ranges}
    points = [dict(traced, **{r.name: size}) for r in ranges for size in _other_sizes(r)]
    for a, b in itertools.combinations(ranges, 2):
        points.append(dict(traced, **{a.name: probe_size(a), b.name: probe_size(b)}))
    return points


def monomials(symbols: Sequence[str]) -> list[str]:
    """The terms of a polynomial of degree at most 2: ``1``, each symbol, each product of two."""
    names = sorted(symbols)
    pairs = itertools.combinations_with_replacement(names, 2)
    return ["1", *names, *(f"{a}*{b}" for a, b in pairs)]


def fit_polynomial(points: Sequence[dict[str, int]], values: Sequence[float]) -> Polynomial:
    """The polynomial of degree at most 2 through ``values`` at ``points`` (least squares where the
    points cannot tell every term apart: a symbol with one size only keeps its linear term)."""
    terms = monomials(sorted(points[0]))
    degree_ok = [
        t
        for t in terms
        if len({tuple(p[s] for s in t.split("*") if s != "1") for p in points}) > 1 or t == "1"
    ]
    matrix = np.array(
        [
            [float(np.prod([p[s] for s in t.split("*") if s != "1"])) for t in degree_ok]
            for p in points
        ]
    )
    norms = np.abs(matrix).max(axis=0)
    norms[norms == 0] = 1.0
    scaled, *_ = np.linalg.lstsq(matrix / norms, np.array(values, dtype=float), rcond=None)
    coefficients = scaled / norms
    out: Polynomial = {}
    scale = max((abs(v) for v in values), default=0.0)
    for term, c in zip(degree_ok, coefficients):
        rounded = round(float(c))
        value = float(rounded) if abs(c - rounded) <= 1e-6 * max(1.0, abs(c)) else float(c)
        if abs(value) > 1e-12 * max(scale, 1.0):
            out[term] = value
    return out


def _counts_at(
    gm: torch.fx.GraphModule,
    groups: Sequence[UnitGroup],
    inputs: tuple[torch.Tensor, ...],
    dynamic: DynamicDims,
    sizes: dict[str, int],
    progress: Callable[[list[UnitRunner]], Iterable[UnitRunner]],
) -> list[UnitCounts]:
    values = train_values(gm, probe_inputs(inputs, dynamic, sizes))
    runners = [UnitRunner(gm, g, values) for g in groups]
    return count_units_once(runners, lambda r: count_unit(r, ops=False), progress)


def unit_scalings(
    gm: torch.fx.GraphModule,
    groups: Sequence[UnitGroup],
    inputs: tuple[torch.Tensor, ...],
    dynamic: DynamicDims,
    ranges: Sequence[DimRange],
    counts: Sequence[UnitCounts],
    preset: DevicePreset,
    progress: Callable[[list[UnitRunner]], Iterable[UnitRunner]] = lambda rs: rs,
) -> list[UnitScaling]:
    """Each unit's :class:`UnitScaling`, from ``counts`` (at the traced sizes) and the units counted
    again at :func:`fit_sizes` (Note [costs at other sizes])."""
    points = [{r.name: r.traced for r in ranges}, *fit_sizes(ranges)]
    at_points = [list(counts)] + [
        _counts_at(gm, groups, inputs, dynamic, p, progress) for p in points[1:]
    ]
    out = []
    for i, base in enumerate(counts):
        per_point = [c[i] for c in at_points]

        def fit(field: Callable[[UnitCounts], Any]) -> Polynomial:
            return fit_polynomial(points, [float(field(c) or 0.0) for c in per_point])

        fwd_ops, bwd_ops = ops_s(base, preset)
        out.append(
            UnitScaling(
                fwd_flops=fit(lambda c: c.fwd_flops),
                bwd_flops=fit(lambda c: c.bwd_flops),
                bwd_input_flops=fit(lambda c: c.bwd_input_flops),
                fwd_bytes=fit(lambda c: c.fwd_bytes),
                activation_bytes=fit(lambda c: c.activation_bytes),
                fwd_ops_ms=fwd_ops * 1e3,
                bwd_ops_ms=bwd_ops * 1e3 if base.has_backward else None,
            )
        )
    return out
