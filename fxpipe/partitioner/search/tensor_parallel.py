"""The cluster search with a tensor-parallel degree T in {1, 2, 4, 8} inside a node.

A tp group of T devices acts as one device of the pipeline x data-parallel search: each degree
searches its own profile (``fxpipe.partitioner.tensor_parallel.tensor_parallel_profile``: split
work / T plus the per-pair all-reduces on the intra-node link and the runtime's cost per pair,
``RuntimeCosts.tp_pair_fwd_ms`` / ``tp_pair_bwd_ms`` of the ``runtime`` the search prices with) on a cluster of ``devices / T``
such groups, ``node_size / T`` to a node. The fastest predicted step wins, and every other
degree says why it lost: TP adds all-reduces that the compute it saves must pay for, and a
degree that divides nothing splits nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.prediction import runtime_costs_for
from fxpipe.partitioner.search.configurations import search_configurations
from fxpipe.partitioner.search.result import SearchResult
from fxpipe.partitioner.tensor_parallel import tensor_parallel_profile
from fxpipe.tracer.profile import ModelProfile

__all__ = ["DegreeOutcome", "search_tensor_parallel"]


@dataclass(frozen=True)
class DegreeOutcome:
    """One degree's best configuration (``None``: it could not run) and its verdict in words."""

    degree: int
    result: SearchResult | None
    note: str

    @property
    def step_ms(self) -> float | None:
        return self.result.best.step_ms if self.result is not None else None


def search_tensor_parallel(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    styles_at: Mapping[int, Mapping[str, str]],
    degrees: Iterable[int] = (1, 2, 4, 8),
    **search: Any,
) -> tuple[DegreeOutcome, list[DegreeOutcome]]:
    """The best degree's outcome and every degree's, fastest first. ``styles_at[T]`` is the
    plan's styles at degree T (module path -> colwise / rowwise); ``search`` goes to
    ``search_configurations``. ``InfeasibleError`` when no degree fits."""
    assert cluster.intra_bandwidth is not None and cluster.intra_latency is not None
    runtime = search.get("runtime") or runtime_costs_for(
        profile.trace_device, profile.host_slowdown
    )
    pair_ms = (runtime.tp_pair_fwd_ms, runtime.tp_pair_bwd_ms)
    outcomes: list[DegreeOutcome] = []
    for degree in degrees:
        if cluster.node_size % degree or cluster.devices % degree:
            outcomes.append(
                DegreeOutcome(
                    degree, None, f"tp {degree} does not divide a node of {cluster.node_size}"
                )
            )
            continue
        styles = dict(styles_at.get(degree, {})) if degree > 1 else {}
        if degree > 1 and not styles:
            outcomes.append(DegreeOutcome(degree, None, f"tp {degree}: the plan splits nothing"))
            continue
        priced = tensor_parallel_profile(
            profile, styles, degree, cluster.intra_bandwidth, cluster.intra_latency, pair_ms
        )
        groups = replace(
            cluster, devices=cluster.devices // degree, node_size=cluster.node_size // degree
        )
        try:
            result = search_configurations(priced, groups, global_batch, **search)
        except InfeasibleError as exc:
            outcomes.append(DegreeOutcome(degree, None, f"tp {degree}: nothing fits ({exc})"))
            continue
        outcomes.append(DegreeOutcome(degree, result, ""))
    ran = sorted((o for o in outcomes if o.result is not None), key=lambda o: o.step_ms or 0.0)
    if not ran:
        raise InfeasibleError(
            "no tensor-parallel degree fits: " + "; ".join(o.note for o in outcomes)
        )
    best = ran[0]
    assert best.result is not None and best.step_ms is not None
    explained = []
    for o in outcomes:
        if o.result is not None and o.step_ms is not None:
            label = o.result.best.config.label
            if o is best:
                note = f"tp {o.degree}: best, {o.step_ms:.1f} ms per step ({label})"
            else:
                note = (
                    f"tp {o.degree}: loses, {o.step_ms:.1f} ms per step, "
                    f"{o.step_ms / best.step_ms:.2f}x tp {best.degree}'s ({label})"
                )
            o = replace(o, note=note)
        explained.append(o)
    explained.sort(key=lambda o: (o.step_ms is None, o.step_ms or 0.0))
    return next(o for o in explained if o.degree == best.degree), explained
