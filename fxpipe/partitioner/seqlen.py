"""The planner at a sequence length, or over a distribution of lengths (``--seq-len``,
``--seq-len-histogram``): a profile traced at one length, priced at others without tracing again.

Note [pricing at a length]: a profile with dynamic dimensions besides the batch (Note [dynamic
dimensions]) carries, per unit, how its counts follow the sizes (``Unit.scaling``, Note [costs
at other sizes] in :mod:`fxpipe.tracer.measure.cost_scaling`) and, per tensor, its shape formula (Note
[shape formulas]). :func:`reprice` evaluates them at other sizes: FLOPs and activation bytes are
the fitted polynomials' values, unit times scale by the analytic estimate's ratio (the roofline
of the new counts plus the unchanged per-op costs, over the same at the old sizes: exactly the
analytic time for an analytic profile, a measured time scaled by the model otherwise), and
messages by the boundary tensors' formulas. :func:`price_over` prices the expected step of a
distribution of lengths: times, FLOPs and message bytes are the weighted means (a split's stage
time is linear in them, so the plan minimises the expected bottleneck of the stage times), while
activation bytes and tensor shapes are those of the longest length: memory must hold at every
length the data brings. The profile records what it was priced at (``ModelProfile.priced_at``),
the plan and its report say it.

A length is given as ``L`` (every dynamic symbol at ``L``: an encoder-decoder's ``seq`` and
``tgt`` alike), ``seq=512,tgt=128``, or a weighted list ``128:3,512:1`` (lengths and weights; the
weights need not sum to one). A histogram file holds one ``LENGTH WEIGHT`` per line (``#``
comments) or a JSON object ``{"LENGTH": WEIGHT}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.errors import ConfigError, PartitionError
from fxpipe.shapeformula import BATCH

if TYPE_CHECKING:
    from fxpipe.tracer.profile import ModelProfile, PricedAt, Unit

__all__ = [
    "Lengths",
    "check_seq_len",
    "parse_seq_len",
    "read_histogram",
    "lengths_for",
    "reprice",
    "price_over",
    "price_for_options",
    "priced_lengths",
]

# what the user asked for: (sizes by symbol, or None for "every symbol", one length, weight)
Lengths = tuple[tuple[dict[str, int] | None, int, float], ...]


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a length (a whole number)") from None
    if value < 1:
        raise ConfigError(f"{what}: the length {value} must be >= 1")
    return value


def _weight(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a weight (a number)") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{what}: the weight {text} must be a finite number >= 0")
    return value


def parse_seq_len(text: str) -> Lengths:
    """``--seq-len``'s value: ``L``, ``seq=L,tgt=M`` or ``L1:W1,L2:W2`` (see the module Note)."""
    what = f"--seq-len {text}"
    items = [i.strip() for i in text.split(",") if i.strip()]
    if not items:
        raise ConfigError(f"{what}: give a length, e.g. --seq-len 512")
    if any("=" in i for i in items):
        sizes: dict[str, int] = {}
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name.strip().isidentifier():
                raise ConfigError(f"{what}: write named lengths as seq=512,tgt=128")
            sizes[name.strip()] = _positive_int(value.strip(), what)
        return ((sizes, 0, 1.0),)
    out = []
    for item in items:
        length, sep, weight = item.partition(":")
        out.append((None, _positive_int(length, what), _weight(weight, what) if sep else 1.0))
    return _normalised(out, what)


def _normalised(items: Sequence[tuple[dict[str, int] | None, int, float]], what: str) -> Lengths:
    total = sum(w for _, _, w in items)
    if total <= 0:
        raise ConfigError(f"{what}: the weights sum to 0; give at least one length a weight")
    merged: dict[int, float] = {}
    for _, length, w in items:
        merged[length] = merged.get(length, 0.0) + w
    return tuple((None, length, w / total) for length, w in sorted(merged.items()) if w > 0)


def check_seq_len(text: str | None) -> str | None:
    """The option's own check (``option(check=...)``): the error line for a malformed value."""
    if text is None:
        return None
    try:
        parse_seq_len(text)
    except ConfigError as exc:
        return str(exc)
    return None


def read_histogram(path: str) -> Lengths:
    """The lengths and weights of a ``--seq-len-histogram`` file (see the module Note)."""
    what = f"--seq-len-histogram {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it: {exc.strerror or exc}") from None
    items: list[tuple[dict[str, int] | None, int, float]] = []
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        for key, value in data.items():
            items.append((None, _positive_int(str(key), what), _weight(str(value), what)))
    else:
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#")[0].replace(",", " ").split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ConfigError(
                    f"{what}, line {number}: write LENGTH WEIGHT, got {line.strip()!r}"
                )
            weight = _weight(fields[1], f"{what}, line {number}") if len(fields) == 2 else 1.0
            items.append((None, _positive_int(fields[0], f"{what}, line {number}"), weight))
    if not items:
        raise ConfigError(f"{what}: the file lists no lengths; write one LENGTH WEIGHT per line")
    return _normalised(items, what)


def lengths_for(profile: ModelProfile, lengths: Lengths) -> tuple[PricedAt, ...]:
    """The asked lengths bound to the profile's dynamic symbols, each checked against its range."""
    from fxpipe.tracer.profile import PricedAt

    if not profile.dynamic:
        raise PartitionError(
            "--seq-len: the profile has no dynamic dimension besides the batch, so it prices its "
            "traced length only; declare the sequence dimension in dynamic_dims() (docs/shapes.md) "
            "and trace again"
        )
    ranges = {r.name: r for r in profile.dynamic}
    out = []
    for named, length, weight in lengths:
        sizes = dict(named) if named is not None else {name: length for name in ranges}
        unknown = sorted(set(sizes) - set(ranges))
        if unknown:
            raise PartitionError(
                f"--seq-len names {unknown}, which the profile does not have; its dynamic dimensions "
                f"are {sorted(ranges)}"
            )
        sizes = {name: sizes.get(name, r.traced) for name, r in ranges.items()}
        for name, size in sizes.items():
            r = ranges[name]
            if not r.holds(size):
                raise PartitionError(
                    f"--seq-len: {name} = {size} is outside the range {r.shown()} the profile was "
                    f"traced for (at {name} = {r.traced}); trace with a dynamic_dims() range that holds it"
                )
        out.append(PricedAt(sizes=sizes, weight=weight))
    return tuple(out)


def priced_lengths(profile: ModelProfile) -> tuple[PricedAt, ...]:
    """The lengths ``profile`` is priced at: those it records, else its traced sizes; () for a profile
    without dynamic dimensions besides the batch."""
    from fxpipe.tracer.profile import PricedAt

    if profile.priced_at:
        return tuple(profile.priced_at)
    if profile.dynamic:
        return (PricedAt(sizes={r.name: r.traced for r in profile.dynamic}),)
    return ()


def _current_sizes(profile: ModelProfile) -> dict[str, int]:
    if len(profile.priced_at) > 1:
        raise PartitionError(
            "this profile is priced over a distribution of lengths; re-price the profile the tracer "
            "wrote (fxpipe trace) instead"
        )
    if profile.priced_at:
        return dict(profile.priced_at[0].sizes)
    return {r.name: r.traced for r in profile.dynamic}


def _unit_at(
    unit: Unit, before: dict[str, int], after: dict[str, int], preset: object | None
) -> Unit:
    from fxpipe.tracer.profile import evaluate_polynomial as poly
    from fxpipe.tracer.measure.timing import roofline_ms

    sc = unit.scaling
    assert sc is not None

    def analytic(sizes: dict[str, int]) -> tuple[float, float]:
        fwd_flops, bwd_flops = poly(sc.fwd_flops, sizes), poly(sc.bwd_flops, sizes)
        if preset is None:  # no device preset to price with: time follows the FLOPs
            return fwd_flops, bwd_flops
        return roofline_ms(
            preset,  # type: ignore[arg-type]
            fwd_flops,
            bwd_flops,
            poly(sc.fwd_bytes, sizes),
            sc.fwd_ops_ms / 1e3,
            None if sc.bwd_ops_ms is None else sc.bwd_ops_ms / 1e3,
        )

    def scaled(value: float, old: float, new: float) -> float:
        return value * new / old if old > 0 else new

    (f0, b0), (f1, b1) = analytic(before), analytic(after)
    act0, act1 = poly(sc.activation_bytes, before), poly(sc.activation_bytes, after)
    fraction = unit.weight_grad_fraction
    bwd_flops = poly(sc.bwd_flops, after)
    if fraction is not None and fraction < 1.0 and bwd_flops > 0:
        fraction = min(1.0, max(0.0, 1.0 - poly(sc.bwd_input_flops, after) / bwd_flops))
    shapes = dict(after)
    return dataclasses.replace(
        unit,
        fwd_ms=max(0.0, scaled(unit.fwd_ms, f0, f1)),
        bwd_ms=max(0.0, scaled(unit.bwd_ms, b0, b1)) if unit.bwd_ms > 0 else 0.0,
        fwd_flops=max(0.0, poly(sc.fwd_flops, after)),
        activation_bytes=max(0, round(scaled(unit.activation_bytes, act0, act1))),
        weight_grad_fraction=fraction,
        outputs=tuple(o.at_sizes(shapes) for o in unit.outputs),
    )


def reprice(profile: ModelProfile, sizes: dict[str, int]) -> ModelProfile:
    """``profile`` priced at ``sizes`` (every dynamic symbol; Note [pricing at a length])."""
    from fxpipe.tracer.measure.calibration import DEVICE_PRESETS
    from fxpipe.tracer.profile import PricedAt, UnitEdge

    before = _current_sizes(profile)
    if any(u.scaling is None for u in profile.units):
        raise PartitionError(
            "--seq-len: this profile does not record how its costs follow the sequence length "
            "(traced by an older fxpipe, written by hand, or its units could not be counted at other "
            "lengths: the trace warned why); trace it again"
        )
    preset = DEVICE_PRESETS.get(profile.trace_device)
    batch = {BATCH: profile.batch_size}
    units = tuple(
        _unit_at(u, {**before, **batch}, {**sizes, **batch}, preset) for u in profile.units
    )
    by_name = {u.name: u for u in units}
    edges = tuple(
        UnitEdge(
            src=e.src,
            dst=e.dst,
            bytes=sum(by_name[e.src].outputs[i].nbytes for i in e.outputs),
            outputs=e.outputs,
        )
        for e in profile.edges
    )
    return dataclasses.replace(
        profile,
        units=units,
        edges=edges,
        inputs=tuple(t.at_sizes({**sizes, **batch}) for t in profile.inputs),
        priced_at=(PricedAt(sizes=dict(sizes)),),
    )


def price_over(profile: ModelProfile, points: Sequence[PricedAt]) -> ModelProfile:
    """``profile`` priced for the expected step over ``points`` (their weights sum to 1): times,
    FLOPs and message bytes averaged, memory at the longest length (Note [pricing at a length])."""
    if len(points) == 1:
        return reprice(profile, dict(points[0].sizes))
    priced = [reprice(profile, dict(p.sizes)) for p in points]
    weights = [p.weight for p in points]
    longest = priced[max(range(len(points)), key=lambda i: sum(points[i].sizes.values()))]

    def mean(values: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(weights, values))

    units = []
    for i, unit in enumerate(longest.units):
        at = [p.units[i] for p in priced]
        bwd = mean([u.bwd_ms for u in at])
        weight_ms = mean([u.bwd_weight_ms for u in at])
        fraction = unit.weight_grad_fraction
        if fraction is not None and bwd > 0:
            fraction = min(1.0, weight_ms / bwd)
        units.append(
            dataclasses.replace(
                unit,
                fwd_ms=mean([u.fwd_ms for u in at]),
                bwd_ms=bwd,
                fwd_flops=mean([u.fwd_flops for u in at]),
                weight_grad_fraction=fraction,
            )
        )
    edges = tuple(
        dataclasses.replace(e, bytes=round(mean([p.edges[j].bytes for p in priced])))
        for j, e in enumerate(longest.edges)
    )
    return dataclasses.replace(longest, units=tuple(units), edges=edges, priced_at=tuple(points))


def price_for_options(
    profile: ModelProfile, seq_len: str | None, histogram: str | None
) -> ModelProfile:
    """The profile the planner prices: ``profile`` at ``--seq-len`` or over ``--seq-len-histogram``
    (neither: as traced)."""
    if seq_len is not None and histogram is not None:
        raise ConfigError("give --seq-len or --seq-len-histogram, not both")
    if seq_len is None and histogram is None:
        return profile
    lengths = parse_seq_len(seq_len) if seq_len is not None else read_histogram(str(histogram))
    return price_over(profile, lengths_for(profile, lengths))
