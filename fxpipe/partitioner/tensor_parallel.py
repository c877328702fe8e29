"""Pricing tensor parallelism: a profile as one rank of a tp group of T sees it, and when TP loses.

The planner and the cluster search price a ``ModelProfile``; tensor parallelism of degree T
changes what one rank of a stage does, so it is priced as a transformed profile
(``tensor_parallel_profile``) that every solver, simulator and report reads unchanged:

- a split linear (``styles``: module path -> ``"colwise"`` / ``"rowwise"``, the build's plan
  at that degree, ``fxpipe.codegen.tp_plan``) and the work inside its group (attention heads,
  the MLP's activation) take 1/T of the time, of the parameters and of the saved activations;
- each row-parallel linear all-reduces its output in the forward, and its group's input
  gradient is all-reduced in the backward: two ring all-reduces of the rowwise output's bytes
  per group per microbatch, ``2 (T-1)/T x bytes / bandwidth + 2 (T-1) x latency`` each, on the
  intra-node link (tp is innermost: Note [DTensor regions] in
  ``fxpipe.runtime.pipeline.tensor_parallel``);
- each split pair also costs the runtime ``pair_ms`` = (forward, backward) milliseconds per
  microbatch beyond its compute share and the all-reduces' link time: DTensor's dispatch and
  redistribution, the collectives' calls on busy cores (``RuntimeCosts.tp_pair_fwd_ms`` /
  ``tp_pair_bwd_ms``, measured by ``benchmarks/prediction/tp_cost.py``: about 5 ms per pair on
  CPU gloo, 15x the tiny GPT's whole MLP; Note [tensor-parallel runtime cost]);
- everything else (norms, replicated linears) is whole on every rank;
- memory is the rank's shards (Note [memory of tensor-parallel shards]).

Note [memory of tensor-parallel shards]: a split parameter's bytes and shape are its local
shard's, as ``parallelize_module`` leaves it: a column-parallel weight and bias and a
vocabulary-parallel embedding or head (``vocab_embedding`` / ``vocab_head``, priced for memory
only: their compute and the embedding's all-reduce are not) lose 1/T of dim 0, a row-parallel
weight 1/T of dim 1, and a row-parallel bias stays whole (``RowwiseParallel`` replicates it).
``CostModel``'s sharding over the replicas (Note [sharding pricing] in
``fxpipe.partitioner.cost``) then applies to those shards, FSDP's padding of dim 0 to a
multiple of R included, as FSDP over TP shards them (Note [FSDP over TP] in
``fxpipe.runtime.dataparallel.sharded``): per rank ``P_split / (T R) + P_replicated / R`` at
``full``.

Note [tensor-parallel runtime cost]:
Priced by link time alone, pp 1 x tp 2 of examples/gpt.py predicted 19 ms a step where it ran
97 ms: on CPU each op of a split region goes through DTensor's Python dispatch (sharding
propagation, redistribution) and each all-reduce through gloo on cores the ranks keep busy,
which cost milliseconds per pair where the pair's compute costs tenths. The cost is per pair and
per microbatch, nearly independent of the width (tp_cost.py: 5.0 and 5.1 ms at widths 32 and
128), so it is a runtime constant per device like the others, charged on the rowwise linear of
each pair. On CUDA it is not measured (0): kernels launch asynchronously there and the host's
dispatch overlaps the device's work while it is shorter.

``tensor_parallel_tradeoff`` compares degrees and says when TP loses: when the all-reduces
cost more than the compute it saves, or when nothing is split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from fxpipe.errors import ConfigError
from fxpipe.tracer.profile import ModelProfile, Unit

__all__ = [
    "TensorParallelCost",
    "allreduce_ms",
    "tensor_parallel_profile",
    "tensor_parallel_tradeoff",
]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_PAIRED = ("colwise", "rowwise")  # priced for compute, all-reduces and memory
_VOCAB = ("vocab_embedding", "vocab_head")  # for memory only


def allreduce_ms(nbytes: float, degree: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``degree`` ranks, in milliseconds.

    >>> round(allreduce_ms(1e6, 4, 1e9, 1e-5), 4)  # 1.5 MB on the wire + 6 hops
    1.56
    """
    if degree <= 1:
        return 0.0
    return 1e3 * (2 * (degree - 1) / degree * nbytes / bandwidth + 2 * (degree - 1) * latency)


def _groups(styles: Mapping[str, str]) -> set[str]:
    return {path.rpartition(".")[0] for path in styles}


def _base(unit: Unit) -> str:
    return unit.module_path.split("#")[0]


def _in_group(unit: Unit, groups: set[str]) -> bool:
    path = _base(unit)
    return any(path == g or path.startswith(g + ".") for g in groups if g)


def _output_bytes(unit: Unit) -> int:
    total = 0
    for spec in unit.outputs:
        n = 1
        for d in spec.shape:
            n *= d
        total += n * _DTYPE_BYTES.get(spec.dtype, 4)
    return total


def _check(degree: int, styles: Mapping[str, str]) -> None:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"tensor-parallel degree must be an int >= 1, got {degree!r}")
    bad = sorted(p for p, s in styles.items() if s not in (*_PAIRED, *_VOCAB))
    if bad:
        raise ConfigError(
            f"tensor-parallel styles must be colwise or rowwise (vocab_embedding or vocab_head "
            f"for memory); {bad[:3]} are not"
        )


def _local_shape(shape: tuple[int, ...], style: str, degree: int) -> tuple[int, ...]:
    """The shape of one rank's shard of a split weight (Note [memory of tensor-parallel shards])."""
    if not shape:
        return shape
    dim = 1 if style == "rowwise" and len(shape) > 1 else 0
    return tuple(n // degree if i == dim else n for i, n in enumerate(shape))


def _share_and_pairs(
    unit: Unit, styles: Mapping[str, str], groups: set[str], split_bytes: int, degree: int
) -> tuple[float, int] | None:
    """The share of ``unit``'s work one rank does, and the pairs whose all-reduces it pays;
    ``None`` for a unit TP leaves whole."""
    path = _base(unit)
    if path in styles or _in_group(unit, groups):  # a split linear, or work between a pair
        return 1.0 / degree, 1 if styles.get(path) == "rowwise" else 0
    rows = [p for p, st in styles.items() if st == "rowwise" and p.startswith(path + ".")]
    if rows and unit.param_bytes:  # a unit holding whole pairs (a transformer block)
        f = min(split_bytes / unit.param_bytes, 1.0)  # matmul work ~ its weights
        return 1.0 - f + f / degree, len(rows)
    return None


def tensor_parallel_profile(
    profile: ModelProfile,
    styles: Mapping[str, str],
    degree: int,
    bandwidth: float,
    latency: float,
    pair_ms: tuple[float, float] = (0.0, 0.0),
) -> ModelProfile:
    """``profile`` as one rank of a tp group of ``degree`` runs it (see the module docstring);
    ``pair_ms``: the runtime's (forward, backward) cost per split pair and microbatch."""
    _check(degree, styles)
    if degree == 1 or not styles:
        return profile
    every = dict(styles)
    styles = {p: st for p, st in every.items() if st in _PAIRED}
    groups = _groups(styles)
    style_of: dict[str, str] = {}  # split parameter -> its module's style
    for name in profile.param_sizes:
        owner = name if name in every else name.rpartition(".")[0]
        st = every.get(owner)
        if st is not None and not (st == "rowwise" and name.endswith(".bias")):
            style_of[name] = st  # a split module's tensors, but a row-parallel bias (replicated)
    split_params = set(style_of)
    units = []
    for unit in profile.units:
        split_bytes = sum(profile.param_sizes.get(p, 0) for p in unit.params if p in split_params)
        found = _share_and_pairs(unit, styles, groups, split_bytes, degree)
        if found is None:  # whole work; a vocabulary-parallel module's shard in memory
            units.append(
                replace(unit, param_bytes=unit.param_bytes - split_bytes + split_bytes // degree)
            )
            continue
        share, pairs = found
        comm = pairs * allreduce_ms(_output_bytes(unit), degree, bandwidth, latency)
        units.append(  # per pair: output all-reduced in forward, the input gradient in backward
            replace(
                unit,
                fwd_ms=unit.fwd_ms * share + comm + pairs * pair_ms[0],
                bwd_ms=unit.bwd_ms * share + comm + pairs * pair_ms[1],
                fwd_flops=unit.fwd_flops * share,
                param_bytes=unit.param_bytes - split_bytes + split_bytes // degree,
                activation_bytes=int(unit.activation_bytes * share),
            )
        )
    sizes = {k: (v // degree if k in split_params else v) for k, v in profile.param_sizes.items()}
    shapes = {
        k: _local_shape(v, style_of[k], degree) if k in style_of else v
        for k, v in profile.param_shapes.items()
    }
    return replace(profile, units=tuple(units), param_sizes=sizes, param_shapes=shapes)


@dataclass(frozen=True)
class TensorParallelCost:
    """One degree's figures per rank and microbatch: compute (forward + backward, all-reduces
    excluded), all-reduce time, parameter bytes; ``saved_ms`` is the compute saved against
    degree 1."""

    degree: int
    compute_ms: float
    comm_ms: float
    param_bytes: int
    saved_ms: float

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    @property
    def loses(self) -> bool:
        """TP of this degree is slower per rank than no TP (or splits nothing)."""
        return self.degree > 1 and self.comm_ms >= self.saved_ms

    def explain(self) -> str:
        if self.degree == 1:
            return (
                f"tp 1: {self.compute_ms:.3f} ms per microbatch, {self.param_bytes} B of parameters"
            )
        verdict = "TP loses" if self.loses else "TP wins"
        return (
            f"tp {self.degree}: compute -{self.saved_ms:.3f} ms, all-reduces +{self.comm_ms:.3f} ms "
            f"per microbatch, parameters {self.param_bytes} B per rank: {verdict}"
        )


def tensor_parallel_tradeoff(
    profile: ModelProfile,
    styles_at: Mapping[int, Mapping[str, str]],
    bandwidth: float,
    latency: float,
    degrees: Iterable[int] = (1, 2, 4, 8),
    pair_ms: tuple[float, float] = (0.0, 0.0),
) -> list[TensorParallelCost]:
    """The whole model's per-rank figures at each degree; ``styles_at[T]`` is the plan's styles at
    degree T (what divides differs by degree). ``comm_ms`` counts the runtime's ``pair_ms`` with
    the all-reduces: both are what TP adds."""
    out = []
    base = sum(u.fwd_ms + u.bwd_ms for u in profile.units)
    for degree in degrees:
        styles = styles_at.get(degree, {}) if degree > 1 else {}
        tp = tensor_parallel_profile(profile, styles, degree, bandwidth, latency, pair_ms)
        comm = 0.0
        if degree > 1:
            for u in profile.units:
                found = _share_and_pairs(u, styles, _groups(styles), 0, degree)
                pairs = found[1] if found is not None else 0
                comm += pairs * (
                    2 * allreduce_ms(_output_bytes(u), degree, bandwidth, latency) + sum(pair_ms)
                )
        total = sum(u.fwd_ms + u.bwd_ms for u in tp.units)
        compute = total - comm
        out.append(
            TensorParallelCost(
                degree, compute, comm, sum(u.param_bytes for u in tp.units), base - compute
            )
        )
    return out
