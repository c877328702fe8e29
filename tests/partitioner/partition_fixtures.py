"""Synthetic profiles and a brute-force oracle shared by the partitioner tests."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from fxpipe.partitioner.problem import PartitionProblem, assignment_violations, evaluate
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge


def chain_profile(times: Sequence[float], edge_bytes: Sequence[int] | None = None, *,
                  params: Sequence[int] | None = None, activations: Sequence[int] | None = None,
                  pins: dict[int, int] | None = None, prefix: str = "layers") -> ModelProfile:
    """A chain u0 -> u1 -> ...; unit i costs times[i] ms (fwd = bwd / 2). Without
    ``edge_bytes`` the units share no edge, so the split costs no communication."""
    n = len(times)
    linked = edge_bytes is not None
    edge_bytes = list(edge_bytes) if edge_bytes is not None else [0] * (n - 1)
    units = tuple(
        Unit(name=f"u{i}", module_path=f"{prefix}.{i}", fwd_ms=t / 3, bwd_ms=2 * t / 3,
             param_bytes=(params[i] if params else 0),
             activation_bytes=(activations[i] if activations else 0),
             outputs=(TensorSpec((1, max(1, (edge_bytes[i] if i < n - 1 else 4) // 4))),),
             pin=(pins or {}).get(i))
        for i, t in enumerate(times)
    )
    edges = tuple(UnitEdge(f"u{i}", f"u{i + 1}", edge_bytes[i]) for i in range(n - 1)) if linked else ()
    return ModelProfile(units=units, edges=edges, batch_size=1)


def random_chain(rng: random.Random, n: int, *, comm: bool = True) -> ModelProfile:
    return chain_profile([rng.uniform(0.1, 5.0) for _ in range(n)],
                         [rng.choice([0, 10**5, 10**6, 10**7]) if comm else 0 for _ in range(n - 1)],
                         params=[rng.randint(0, 4) * 1000 for _ in range(n)],
                         activations=[rng.randint(0, 4) * 500 for _ in range(n)])


def random_dag(rng: random.Random, n: int) -> ModelProfile:
    """A random DAG in topological order: a backbone chain plus random skip edges."""
    units = tuple(Unit(name=f"u{i}", module_path=f"net.{i}", fwd_ms=rng.uniform(0.1, 3), bwd_ms=rng.uniform(0.1, 3),
                       param_bytes=rng.randint(0, 3) * 1000, activation_bytes=rng.randint(0, 3) * 100,
                       outputs=(TensorSpec((1, 1000)),))
                  for i in range(n))
    pairs = {(i, i + 1) for i in range(n - 1)}
    for _ in range(n):
        a = rng.randrange(n - 1)
        b = rng.randrange(a + 1, n)
        pairs.add((a, b))
    edges = tuple(UnitEdge(f"u{a}", f"u{b}", rng.choice([10**5, 10**6, 4 * 10**6])) for a, b in sorted(pairs))
    return ModelProfile(units=units, edges=edges, batch_size=1)


def brute_force(problem: PartitionProblem, *, contiguous: bool = False) -> tuple[float, tuple[int, ...]] | None:
    """The least bottleneck over every valid assignment (or every contiguous split)."""
    n, S = problem.num_units, problem.num_stages
    best: tuple[float, tuple[int, ...]] | None = None
    if contiguous:
        candidates = (tuple(j for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))) for _ in range(a, b))
                      for cuts in itertools.combinations(range(1, n), S - 1))
    else:
        candidates = itertools.product(range(S), repeat=n)
    for a in candidates:
        if assignment_violations(problem, a):
            continue
        value = evaluate(problem, a).bottleneck_ms
        if best is None or value < best[0]:
            best = (value, tuple(a))
    return best
