"""Synthetic profiles and a brute-force oracle shared by the partitioner tests."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from fxpipe.partitioner.problem import PartitionProblem, Tensor, assignment_violations, evaluate
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge


def chain_profile(
    times: Sequence[float],
    edge_bytes: Sequence[int] | None = None,
    *,
    params: Sequence[int] | None = None,
    activations: Sequence[int] | None = None,
    pins: dict[int, int] | None = None,
    prefix: str = "layers",
) -> ModelProfile:
    """A chain u0 -> u1 -> ...; unit i costs times[i] ms (fwd = bwd / 2). Without
    ``edge_bytes`` the units share no edge, so the split costs no communication."""
    n = len(times)
    linked = edge_bytes is not None
    edge_bytes = list(edge_bytes) if edge_bytes is not None else [0] * (n - 1)
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"{prefix}.{i}",
            fwd_ms=t / 3,
            bwd_ms=2 * t / 3,
            param_bytes=(params[i] if params else 0),
            activation_bytes=(activations[i] if activations else 0),
            outputs=(TensorSpec((1, max(1, (edge_bytes[i] if i < n - 1 else 4) // 4))),),
            pin=(pins or {}).get(i),
        )
        for i, t in enumerate(times)
    )
    edges = (
        tuple(UnitEdge(f"u{i}", f"u{i + 1}", edge_bytes[i]) for i in range(n - 1)) if linked else ()
    )
    return ModelProfile(units=units, edges=edges, batch_size=1)


def random_chain(rng: random.Random, n: int, *, comm: bool = True) -> ModelProfile:
    return chain_profile(
        [rng.uniform(0.1, 5.0) for _ in range(n)],
        [rng.choice([0, 10**5, 10**6, 10**7]) if comm else 0 for _ in range(n - 1)],
        params=[rng.randint(0, 4) * 1000 for _ in range(n)],
        activations=[rng.randint(0, 4) * 500 for _ in range(n)],
    )


def random_dag(rng: random.Random, n: int) -> ModelProfile:
    """A random DAG in topological order: a backbone chain plus random skip edges."""
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"net.{i}",
            fwd_ms=rng.uniform(0.1, 3),
            bwd_ms=rng.uniform(0.1, 3),
            param_bytes=rng.randint(0, 3) * 1000,
            activation_bytes=rng.randint(0, 3) * 100,
            outputs=(TensorSpec((1, 1000)),),
        )
        for i in range(n)
    )
    pairs = {(i, i + 1) for i in range(n - 1)}
    for _ in range(n):
        a = rng.randrange(n - 1)
        b = rng.randrange(a + 1, n)
        pairs.add((a, b))
    edges = tuple(
        UnitEdge(f"u{a}", f"u{b}", rng.choice([10**5, 10**6, 4 * 10**6])) for a, b in sorted(pairs)
    )
    return ModelProfile(units=units, edges=edges, batch_size=1)


def brute_force(
    problem: PartitionProblem, *, contiguous: bool = False
) -> tuple[float, tuple[int, ...]] | None:
    """The least bottleneck over every valid assignment (or every contiguous split)."""
    n, S = problem.num_units, problem.num_stages
    best: tuple[float, tuple[int, ...]] | None = None
    if contiguous:
        candidates = (
            tuple(j for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))) for _ in range(a, b))
            for cuts in itertools.combinations(range(1, n), S - 1)
        )
    else:
        candidates = itertools.product(range(S), repeat=n)
    for a in candidates:
        if assignment_violations(problem, a):
            continue
        value = evaluate(problem, a).bottleneck_ms
        if best is None or value < best[0]:
            best = (value, tuple(a))
    return best


def random_chain_problem(
    rng: random.Random, n: int, num_stages: int, *, microbatches: int = 4
) -> PartitionProblem:
    """A chain of ``n`` units as a ``PartitionProblem`` (no profile needed), with own parameters,
    activations and cut tensors of very different sizes, so boundary buffers matter."""
    return PartitionProblem(
        names=tuple(f"u{i}" for i in range(n)),
        module_paths=tuple(f"m.{i}" for i in range(n)),
        fwd_ms=tuple(rng.uniform(0.1, 2) for _ in range(n)),
        bwd_ms=tuple(rng.uniform(0.1, 4) for _ in range(n)),
        activation_bytes=tuple(rng.randint(0, 10**6) for _ in range(n)),
        buffer_bytes=(0,) * n,
        unit_params=tuple((i,) for i in range(n)),
        param_bytes=tuple(rng.randint(0, 10**6) for _ in range(n)),
        param_names=tuple(f"p{i}" for i in range(n)),
        tensors=tuple(
            Tensor(i, (i + 1,), rng.choice([0, 10**5, 10**6, 10**7, 5 * 10**7]))
            for i in range(n - 1)
        ),
        pins=(None,) * n,
        num_stages=num_stages,
        microbatches=microbatches,
    )


def branchy_profile() -> ModelProfile:
    """The traced profile of ``examples/branchy.py`` (batch 2, analytic times) as literals:
    two encoders, parallel left/right branches, a merge and a skip from ``enc_x`` to it."""
    rows = [  # name, fwd_ms, bwd_ms, param_bytes, activation_bytes, output elements
        ("enc_x.0", 0.0088, 0.0409, 2176, 128, 64),
        ("enc_x.1", 0.0087, 0.0082, 0, 256, 64),
        ("enc_y.0", 0.0088, 0.0407, 1152, 64, 64),
        ("enc_y.1", 0.0087, 0.0082, 0, 256, 64),
        ("left.0", 0.0089, 0.0411, 4224, 256, 64),
        ("left.1", 0.0087, 0.0082, 0, 256, 64),
        ("left.2", 0.0089, 0.0411, 4224, 256, 64),
        ("right.0", 0.0092, 0.0415, 8448, 256, 128),
        ("right.1", 0.0044, 0.0042, 0, 512, 128),
        ("right.2", 0.0135, 0.0497, 8320, 512, 128),
        ("merge", 0.0179, 0.0497, 8320, 1024, 64),
        ("head", 0.0087, 0.0407, 528, 256, 8),
    ]
    units = tuple(
        Unit(
            name=name,
            module_path=name,
            fwd_ms=f,
            bwd_ms=b,
            param_bytes=p,
            activation_bytes=a,
            outputs=(TensorSpec((2, elements // 2)),),
        )
        for name, f, b, p, a, elements in rows
    )
    edges = tuple(
        UnitEdge(src, dst, nbytes)
        for src, dst, nbytes in [
            ("enc_x.0", "enc_x.1", 256),
            ("enc_y.0", "enc_y.1", 256),
            ("enc_x.1", "left.0", 256),
            ("left.0", "left.1", 256),
            ("left.1", "left.2", 256),
            ("enc_x.1", "right.0", 256),
            ("right.0", "right.1", 512),
            ("right.1", "right.2", 512),
            ("left.2", "right.2", 256),
            ("right.2", "merge", 512),
            ("enc_y.1", "merge", 256),
            ("enc_x.1", "merge", 256),
            ("merge", "head", 256),
        ]
    )
    return ModelProfile(units=units, edges=edges, batch_size=2)
