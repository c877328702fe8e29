"""``--time-limit`` bounds the planner: CP-SAT's model building and solve share one budget."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "partitioner"))
from partition_fixtures import random_dag  # noqa: E402

from fxpipe.partitioner import build_problem, plan_partition, solve_dag_cpsat  # noqa: E402
from fxpipe.partitioner.solve.baselines import run_baseline  # noqa: E402

MARGIN_S = (
    1.5  # CP-SAT stops its presolve steps on deterministic time; a busy machine stretches them
)


@pytest.fixture(scope="module")
def big_problem():  # type: ignore[no-untyped-def]
    """1000 units x 24 stages with a binding memory limit: building its CP-SAT model alone takes seconds."""
    return build_problem(random_dag(random.Random(0), 1000), 24, memory_limit=120_000_000)


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_cpsat_model_building_counts_against_the_limit(big_problem, optimize: str) -> None:  # type: ignore[no-untyped-def]
    hint = run_baseline("uniform", big_problem).assignment
    start = time.perf_counter()
    solution = solve_dag_cpsat(big_problem, hint=hint, time_limit=1.0, optimize=optimize)
    assert time.perf_counter() - start < 1.0 + MARGIN_S
    assert solution.assignment == tuple(hint) and "kept the hint" in solution.status


def test_plan_partition_stays_within_the_limit() -> None:
    profile = random_dag(random.Random(1), 300)
    limit = 3.0
    start = time.perf_counter()
    plan = plan_partition(profile, 8, solver="cpsat", time_limit=limit, optimize="memory")
    assert time.perf_counter() - start < limit + MARGIN_S
    assert plan.solve_seconds < limit + MARGIN_S
