"""``ModelProfile``: what the tracer learned about a model, in plain data.

The partitioner reads nothing else, so a profile written by another tool (or edited
by hand for a what-if study) plans exactly like one traced here.

Reading a profile checks every field against its type hint (``fxpipe.schema``); the
documented minimal profile (units with ``name``, ``fwd_ms``, ``bwd_ms``, ``param_bytes``,
``activation_bytes``, ``outputs``; edges with ``src``, ``dst``, ``bytes``; ``batch_size``)
is complete enough: a unit without ``module_path`` takes its name as the path. Schema
version 1 (a ``model`` object with a ``class`` key) is read by renaming that key.

Note [model inputs]: the model's own inputs are not units and travel on no edge.
Every pipeline rank reads the batch itself (as with the seed API's ``smp.step``), so a
unit that consumes a model input needs no transfer for it. ``ModelProfile.inputs``
records their specs and ``Unit.reads_inputs`` which of them a unit reads.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.errors import ProfileError
from fxpipe.jsonio import check_schema_version, dump_json, load_json
from fxpipe.shapeformula import DimRange, evaluate
from fxpipe.schema import NonNegFloat, NonNegInt, PositiveInt, read_dataclass
from fxpipe.tracer.measure.calibration import host_slowdown

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "TensorSpec",
    "Unit",
    "UnitScaling",
    "PricedAt",
    "evaluate_polynomial",
    "UnitEdge",
    "ModelInfo",
    "ModelProfile",
    "PROFILE_SCHEMA_VERSION",
    "WEIGHT_GRAD_FALLBACK",
]

WEIGHT_GRAD_FALLBACK = (
    0.5  # weight-gradient share of bwd_ms for units of profiles that do not record it
)
PROFILE_SCHEMA_VERSION = 2  # 2: ``model`` is a ModelInfo (``class_name`` instead of ``class``)
_OLDEST_READABLE = 1
_REMEDY = "re-trace the model with `fxpipe trace`"

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "symint": 8,  # a symbolic size travelling as a Python int
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"``."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ProfileError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor at the traced batch size.

    ``batch_dim`` is the dimension that scales with the batch (``None`` when the
    tensor does not depend on it, e.g. a causal mask). ``requires_grad`` says whether a
    gradient flows back through it (token ids and masks get none). ``dims``: each dimension's
    formula in the dynamic sizes (Note [shape formulas] in :mod:`fxpipe.shapeformula`);
    ``None`` in profiles written before formulas.
    """

    shape: tuple[NonNegInt, ...]
    dtype: str = "float32"
    batch_dim: int | None = 0
    requires_grad: bool = True
    dims: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        dtype_bytes(self.dtype)
        if self.batch_dim is not None and not 0 <= self.batch_dim < max(len(self.shape), 1):
            raise ProfileError(f"batch_dim {self.batch_dim} out of range for shape {self.shape}")
        if self.dims is not None and len(self.dims) != len(self.shape):
            raise ProfileError(f"dims {list(self.dims)} do not match the shape {list(self.shape)}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def at_batch(self, batch_size: int, traced_batch: int) -> tuple[int, ...]:
        """The shape this tensor has when the batch is ``batch_size`` instead of ``traced_batch``."""
        if self.batch_dim is None:
            return self.shape
        shape = list(self.shape)
        per_sample, rem = divmod(shape[self.batch_dim], traced_batch)
        if rem:
            raise ProfileError(
                f"dimension {self.batch_dim} of {self.shape} is not a multiple of the traced batch {traced_batch}"
            )
        shape[self.batch_dim] = per_sample * batch_size
        return tuple(shape)

    def at_sizes(self, sizes: dict[str, int]) -> TensorSpec:
        """This tensor at other dynamic sizes (symbol -> size, ``mb`` included), by its formulas; a
        dimension without one (``"?"``, or no ``dims``) keeps its traced size."""
        if self.dims is None:
            return self
        shape = []
        for size, formula in zip(self.shape, self.dims):
            try:
                shape.append(evaluate(formula, sizes))
            except (KeyError, ValueError):
                shape.append(size)
        return dataclasses.replace(self, shape=tuple(shape))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return read_dataclass(cls, d, "tensor spec", ProfileError)


Polynomial = dict[str, float]  # monomial ("1", "seq", "seq*seq", "seq*tgt") -> coefficient


def evaluate_polynomial(poly: Polynomial, sizes: dict[str, int]) -> float:
    """The value of ``poly`` at ``sizes`` (symbol -> size)."""
    total = 0.0
    for monomial, coefficient in poly.items():
        term = float(coefficient)
        for symbol in monomial.split("*"):
            if symbol != "1":
                term *= sizes[symbol]
        total += term
    return total


@dataclass(frozen=True)
class UnitScaling:
    """How one unit's counts follow the dynamic sizes besides the batch (Note [costs at other sizes]
    in :mod:`fxpipe.tracer.measure.cost_scaling`): forward and backward FLOPs, the input gradients' share of
    the backward FLOPs, the bytes the forward reads and writes, and the activation bytes, each a
    polynomial of degree at most 2 in the symbols (at the traced batch); and the fixed per-op
    milliseconds of the analytic estimate, which do not follow the sizes."""

    fwd_flops: Polynomial
    bwd_flops: Polynomial
    bwd_input_flops: Polynomial
    fwd_bytes: Polynomial
    activation_bytes: Polynomial
    fwd_ops_ms: NonNegFloat
    bwd_ops_ms: NonNegFloat | None  # None: the unit has no backward

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitScaling:
        return read_dataclass(cls, d, "unit scaling", ProfileError)


@dataclass(frozen=True)
class PricedAt:
    """One sequence length (a size per dynamic symbol) a profile's costs are priced at, and its weight
    in the expected step (1.0 for a single length)."""

    sizes: dict[str, PositiveInt]
    weight: NonNegFloat = 1.0

    def shown(self) -> str:
        return ", ".join(f"{k} = {v}" for k, v in self.sizes.items())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PricedAt:
        return read_dataclass(cls, d, "priced length", ProfileError)


@dataclass(frozen=True)
class Unit:
    """The smallest piece the partitioner places: one leaf module call, or a run of
    FX nodes that belong to the same module path.

    Times are for ONE microbatch at the profiled batch size. ``param_bytes`` counts
    each parameter once over the whole profile (a tied parameter is charged to its
    first user and listed in every user's ``params``), so the units' sum is the
    model's parameter size.
    """

    name: str
    module_path: str
    kind: str = "module"
    module_type: str | None = None
    outputs: tuple[TensorSpec, ...] = ()
    fwd_ms: NonNegFloat = 0.0
    bwd_ms: NonNegFloat = 0.0
    fwd_flops: NonNegFloat = 0.0
    param_bytes: NonNegInt = 0
    buffer_bytes: NonNegInt = 0
    activation_bytes: NonNegInt = 0
    params: tuple[str, ...] = ()
    reads_inputs: tuple[NonNegInt, ...] = ()
    pin: NonNegInt | None = None
    random: bool = (
        False  # draws random numbers (dropout): such units keep their program order across stages
    )
    weight_grad_fraction: NonNegFloat | None = (
        None  # of bwd_ms, the weight gradients' share (from FLOPs)
    )
    saved_tensors: NonNegInt | None = (
        None  # tensors autograd saves for backward per forward; None: not counted
    )
    scaling: UnitScaling | None = None  # how the counts follow the dynamic sizes; None: not fitted

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "outputs",
            tuple(
                o if isinstance(o, TensorSpec) else TensorSpec.from_dict(o) for o in self.outputs
            ),
        )
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "reads_inputs", tuple(self.reads_inputs))
        if not self.name:
            raise ProfileError("a unit needs a non-empty name")
        for label, value in (
            ("fwd_ms", self.fwd_ms),
            ("bwd_ms", self.bwd_ms),
            ("param_bytes", self.param_bytes),
            ("activation_bytes", self.activation_bytes),
        ):
            if not value >= 0 or not math.isfinite(value):
                raise ProfileError(
                    f"unit {self.name!r}: {label} must be a finite number >= 0, got {value}"
                )
        if self.pin is not None and self.pin < 0:
            raise ProfileError(
                f"unit {self.name!r}: pin must be a stage index >= 0, got {self.pin}"
            )

    @property
    def compute_ms(self) -> float:
        """Forward plus backward time of one microbatch."""
        return self.fwd_ms + self.bwd_ms

    @property
    def bwd_weight_ms(self) -> float:
        """The part of ``bwd_ms`` that computes weight gradients (a zero-bubble schedule's ``W``):
        ``weight_grad_fraction`` from the unit's FLOPs, or for profiles without it a fixed
        ``WEIGHT_GRAD_FALLBACK`` of units with parameters (input and weight gradients of a
        matmul cost the same)."""
        if self.weight_grad_fraction is not None:
            return self.bwd_ms * min(self.weight_grad_fraction, 1.0)
        return self.bwd_ms * WEIGHT_GRAD_FALLBACK if (self.param_bytes or self.params) else 0.0

    @property
    def output_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Unit:
        """A unit from JSON; without ``module_path`` its name stands for the path (minimal profiles)."""
        return read_dataclass(cls, _with_module_path(d), "unit", ProfileError)


@dataclass(frozen=True)
class UnitEdge:
    """Data flowing from ``src`` to ``dst``: the listed outputs of ``src``.

    ``bytes`` is their total size per microbatch. Two edges from one producer into the
    same stage carry the same tensor once, which is why the edge names its outputs.
    """

    src: str
    dst: str
    bytes: NonNegInt
    outputs: tuple[NonNegInt, ...] = (0,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if self.bytes < 0:
            raise ProfileError(f"edge {self.src}->{self.dst}: negative bytes")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitEdge:
        return read_dataclass(cls, d, "edge", ProfileError)


@dataclass(frozen=True)
class ModelInfo:
    """Where a profile's model came from, as far as it is known (every field optional).

    ``name`` is a label for reports (a profile written by hand or by a benchmark),
    ``class_name`` the model's ``module.QualName``, ``file``/``sha256``/``factory`` the model
    file, its hash and the function that builds the model.
    """

    name: str | None = None
    class_name: str | None = None
    file: str | None = None
    sha256: str | None = None
    factory: str | None = None

    @property
    def title(self) -> str:
        """What reports call the model: its name, else its file, else ``"model"``."""
        return self.name or self.file or "model"


@dataclass(frozen=True)
class ModelProfile:
    """Units in topological order, the edges between them, and how they were measured.

    ``batch_size`` is the (micro)batch the units were profiled at. ``param_sizes`` maps
    every parameter name to its bytes (tied parameters once, under the name in
    ``ties[k][0]``); ``ties`` lists the groups of names that are one tensor.
    ``param_shapes`` gives their shapes under the same names (empty in profiles written
    before it existed), so the cost model can price PowerSGD's matrix view of each gradient.
    ``meta``: traced with meta tensors (Note [meta tracing] in :mod:`fxpipe.tracer.measure.meta`);
    ``skipped_checks`` names the checks that could not run then, with the reason;
    ``recomputed_buffers`` the buffers a model built on meta held no value for and that were
    recomputed on the CPU, one line each (Note [computed buffers on meta] in
    :mod:`fxpipe.tracer.construct.meta_buffers`).
    ``host_call_ms``: the fixed cost of calling a unit, measured beside the unit times (``None``:
    times not measured); ``host_slowdown`` compares it with the calibration host's (Note
    [host speed] in :mod:`fxpipe.tracer.measure.calibration`). ``dynamic``: the dimensions besides the
    batch that follow the data, with their ranges (Note [dynamic dimensions] in
    :mod:`fxpipe.tracer.dynamic`); the tensors' ``dims`` are formulas in them, and each unit's
    ``scaling`` says how its counts follow them. ``priced_at``: the lengths the costs are for, when
    the planner re-priced the profile (``--seq-len``, Note [pricing at a length] in
    :mod:`fxpipe.partitioner.seqlen`; several: the expected step over them, memory at the longest);
    empty: the traced sizes.
    ``compiled``: the units were priced as compiled stages run them (``--compile``; Note
    [compiled unit times] in :mod:`fxpipe.tracer.measure.timing`), ``compile_factor`` the factor the
    analytic estimate was scaled by (``None``: measured, or eager).
    """

    units: tuple[Unit, ...]
    edges: tuple[UnitEdge, ...]
    batch_size: PositiveInt
    inputs: tuple[TensorSpec, ...] = ()
    trace_device: str = "cpu"
    frontend: str = "symbolic"
    timing: str = (
        "given"  # the tracer's "analytic" or "measured"; "given": set by whoever wrote the profile
    )
    module_order: tuple[str, ...] = ()
    param_sizes: dict[str, NonNegInt] = field(default_factory=dict)
    ties: tuple[tuple[str, ...], ...] = ()
    model: ModelInfo = field(default_factory=ModelInfo)
    schema_version: int = PROFILE_SCHEMA_VERSION
    param_shapes: dict[str, tuple[NonNegInt, ...]] = field(default_factory=dict)
    meta: bool = False
    skipped_checks: tuple[str, ...] = ()
    host_call_ms: NonNegFloat | None = None
    recomputed_buffers: tuple[str, ...] = ()
    dynamic: tuple[DimRange, ...] = ()
    compiled: bool = False  # priced as compiled stages (--compile); older profiles: eager
    compile_factor: NonNegFloat | None = None  # the analytic times' compiled-kernel factor
    priced_at: tuple[PricedAt, ...] = ()  # the lengths the costs are for; (): the traced sizes

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "skipped_checks", tuple(self.skipped_checks))
        object.__setattr__(self, "recomputed_buffers", tuple(self.recomputed_buffers))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "module_order", tuple(self.module_order))
        object.__setattr__(self, "ties", tuple(tuple(t) for t in self.ties))
        object.__setattr__(
            self,
            "param_shapes",
            {k: tuple(int(d) for d in v) for k, v in self.param_shapes.items()},
        )
        if self.batch_size < 1:
            raise ProfileError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.units:
            raise ProfileError("a profile needs at least one unit")
        index: dict[str, int] = {}
        for i, u in enumerate(self.units):
            if u.name in index:
                raise ProfileError(f"duplicate unit name {u.name!r}")
            index[u.name] = i
        for e in self.edges:
            if e.src not in index or e.dst not in index:
                missing = e.src if e.src not in index else e.dst
                raise ProfileError(f"edge {e.src}->{e.dst} names unknown unit {missing!r}")
            if index[e.src] >= index[e.dst]:
                raise ProfileError(
                    f"edge {e.src}->{e.dst} goes backwards: units must be listed in topological order"
                )

    # -- views -----------------------------------------------------------------

    @property
    def unit_index(self) -> dict[str, int]:
        """Position of each unit in the topological order."""
        return {u.name: i for i, u in enumerate(self.units)}

    @property
    def total_param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)

    @property
    def total_compute_ms(self) -> float:
        return sum(u.compute_ms for u in self.units)

    @property
    def host_slowdown(self) -> float:
        """How much slower than the calibration host's quiet speed the trace ran (1.0: unknown;
        Note [host speed])."""
        return host_slowdown(self.trace_device, self.host_call_ms)

    @property
    def is_chain(self) -> bool:
        """True when every edge joins neighbours in the order (no branch or skip)."""
        idx = self.unit_index
        return all(idx[e.dst] == idx[e.src] + 1 for e in self.edges)

    def graph(self) -> nx.DiGraph:
        """The units as a networkx DiGraph (node attribute ``unit``, edge attribute ``bytes``)."""
        import networkx as nx

        g = nx.DiGraph()
        for u in self.units:
            g.add_node(u.name, unit=u)
        for e in self.edges:
            if g.has_edge(e.src, e.dst):
                g[e.src][e.dst]["bytes"] += e.bytes
            else:
                g.add_edge(e.src, e.dst, bytes=e.bytes, outputs=e.outputs)
        return g

    # -- JSON ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for u in d["units"]:
            u["outputs"] = [dict(o, shape=list(o["shape"])) for o in u["outputs"]]
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path, what="profile", error=ProfileError)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """A profile from JSON data, every field checked (one ``ProfileError`` naming the field).

        Reads schema versions 1 and 2; fills what the minimal profile leaves out.
        """
        version = check_schema_version(
            d,
            PROFILE_SCHEMA_VERSION,
            "profile",
            ProfileError,
            oldest=_OLDEST_READABLE,
            remedy=_REMEDY,
        )
        data = dict(d, schema_version=PROFILE_SCHEMA_VERSION)
        if version == 1 and isinstance(data.get("model"), dict) and "class" in data["model"]:
            data["model"] = {**data["model"], "class_name": data["model"]["class"]}
        if isinstance(data.get("units"), list):
            data["units"] = [_with_module_path(u) for u in data["units"]]
        return read_dataclass(cls, data, "profile", ProfileError)

    @classmethod
    def from_json(cls, source: str | Path) -> ModelProfile:
        """Load from a path or a JSON string."""
        return cls.from_dict(load_json(source, "profile", ProfileError))


def _with_module_path(unit: Any) -> Any:
    """A unit's JSON object with ``module_path`` defaulting to its name (minimal profiles)."""
    if isinstance(unit, dict) and "module_path" not in unit and isinstance(unit.get("name"), str):
        return {**unit, "module_path": unit["name"]}
    return unit
