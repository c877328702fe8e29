"""OR-Tools CP-SAT model of the exact cost (Note [stage cost]) over the unit DAG.

Note [CP-SAT encoding]: the stage of unit u is order-encoded, ``ge[u][s]`` <=> stage(u)
>= s, so "data flows forward" is one implication per edge and stage, ``ge[u][s] =>
ge[v][s]`` (so is the order of random units, Note [random order] in problem.py), and
"u is on stage s" is the linear term ``ge[u][s] - ge[u][s+1]``. Pins
and the stage ranges they imply fix variables up front. For each tensor t and stage s,
``recv[t][s] >= on(c, s) - ge[p][s]`` for every consumer c (s receives t when it holds
a consumer but not the producer p); the producer's stage sends ``n_t = sum_s
recv[t][s]`` messages, linearised as ``w[t][a] >= n_t - M (1 - on(p, a))``. With several
stages per rank, a receive is a message only when no stage of s's rank holds p:
``remote[t][s] >= recv[t][s] - sum on(p, q)`` over those stages q, which replaces
``recv[t][s]`` in time and memory (Note [stage cost]: such tensors are handed over). The model
only bounds these from below, which is exact at the optimum since they only add cost.
Times are floored to integers of 10 ns, so the proven bound is a valid
lower bound for the float cost model; memory is in bytes. The bottleneck ``T`` bounds
every stage's time and is minimised; the DP (or best heuristic) answer is the hint.

Note [CP-SAT time budget]: ``time_limit`` bounds the whole call, model building included:
building a large model in Python takes seconds, so it checks the clock per unit, tensor
and stage and gives up (keeping the hint) once the budget is spent; the solver gets what
is left. CP-SAT checks its own limit in deterministic time during parts of its presolve,
which can run several times longer in wall time than their deterministic estimate on a
busy machine; the costliest of them on these models (turning clauses into exactly-one
constraints, seconds on a 1000-unit model) is switched off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from fxpipe.errors import InfeasibleError, PartitionError
from fxpipe.partitioner.solve.pin_ranges import stage_ranges
from fxpipe.partitioner.problem import PartitionProblem, evaluate
from fxpipe.partitioner.solve.solution import Solution

__all__ = ["solve_dag_cpsat", "SCALE"]

SCALE = 100_000  # integer time units per millisecond (10 ns)


class _OutOfTime(Exception):
    """Building the model used up the time budget (Note [CP-SAT time budget])."""


class _Model:
    """The CP-SAT variables and per-stage time/memory expressions of one problem."""

    def __init__(
        self, problem: PartitionProblem, with_memory: bool, deadline: float = math.inf
    ) -> None:
        self.p = problem
        self.deadline = deadline
        self.m = cp_model.CpModel()
        n, S = problem.num_units, problem.num_stages
        self.lo, self.hi = stage_ranges(problem)
        m = self.m
        # ge[u][s] for s in 0..S; ge[u][0] == 1 and ge[u][S] == 0 are constants.
        self.ge: list[list[Any]] = []
        for u in range(n):
            self._tick()
            row: list[Any] = [1]
            for s in range(1, S):
                if s <= self.lo[u]:
                    row.append(1)
                elif s > self.hi[u]:
                    row.append(0)
                else:
                    row.append(m.new_bool_var(f"ge_{u}_{s}"))
            row.append(0)
            self.ge.append(row)
            for s in range(2, S):
                if not isinstance(row[s], int) and not isinstance(row[s - 1], int):
                    m.add_implication(row[s], row[s - 1])
        for t in problem.tensors:
            self._tick()
            for c in t.consumers:
                self._not_later(t.producer, c)
        for a, b in zip(
            problem.random_units, problem.random_units[1:]
        ):  # Note [random order] in problem.py
            self._not_later(a, b)
        for s in range(S):
            m.add(sum(self.on(u, s) for u in range(n) if self.lo[u] <= s <= self.hi[u]) >= 1)
        self._comm()
        speeds = problem.speeds
        self.time: list[Any] = []
        for s in range(S):
            self._tick()
            expr = sum(
                math.floor((problem.fwd_ms[u] + problem.bwd_ms[u]) / speeds[s] * SCALE)
                * self.on(u, s)
                for u in range(n)
                if self.lo[u] <= s <= self.hi[u]
            )
            for t, ms in zip(problem.tensors, self.msg):
                if s in self.recv[id(t)]:
                    expr += ms * self.recv[id(t)][s]
                if s in self.w[id(t)]:
                    expr += ms * self.w[id(t)][s]
            self.time.append(expr)
        self.memory: list[Any] = self._memory() if with_memory else []

    def _tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def _not_later(self, u: int, v: int) -> None:
        """stage(u) <= stage(v): ``ge[u][s] => ge[v][s]`` for every stage s (constants folded)."""
        for s in range(1, self.p.num_stages):
            a, b = self.ge[u][s], self.ge[v][s]
            if isinstance(a, int) and isinstance(b, int):
                if a > b:
                    self.m.add_bool_or([])  # the pins put v before u: infeasible
            elif isinstance(a, int):
                if a == 1:
                    self.m.add(b == 1)
            elif isinstance(b, int):
                if b == 0:
                    self.m.add(a == 0)
            else:
                self.m.add_implication(a, b)

    def on(self, u: int, s: int) -> Any:
        return self.ge[u][s] - self.ge[u][s + 1]

    def _comm(self) -> None:
        p, m, S = self.p, self.m, self.p.num_stages
        self.msg = [
            math.floor(
                p.cost.message_ms(p.cost.wire_bytes(t.nbytes))
                * (2 if t.requires_grad else 1)
                * SCALE
            )
            for t in p.tensors
        ]
        self.recv: dict[int, dict[int, Any]] = {}
        self.held: dict[
            int, dict[int, Any]
        ] = {}  # stages whose rank-mate may hold the producer: any receive
        self.w: dict[int, dict[int, Any]] = {}
        ranks = p.stage_ranks
        for t in p.tensors:
            self._tick()
            pr = t.producer
            recv: dict[int, Any] = {}
            for s in range(1, S):
                if self.lo[pr] < s and any(self.lo[c] <= s <= self.hi[c] for c in t.consumers):
                    var = m.new_bool_var(f"recv_{pr}_{s}")
                    for c in t.consumers:
                        if self.lo[c] <= s <= self.hi[c]:
                            m.add(var >= self.on(c, s) - self.ge[pr][s])
                    recv[s] = var
            held: dict[int, Any] = {}
            for s, var in list(
                recv.items()
            ):  # a producer on a stage of the same rank sends no message
                mates = [
                    q for q in range(self.lo[pr], min(s, self.hi[pr] + 1)) if ranks[q] == ranks[s]
                ]
                if mates:
                    remote = m.new_bool_var(f"remote_{pr}_{s}")
                    m.add(remote >= var - sum(self.on(pr, q) for q in mates))
                    held[s], recv[s] = var, remote
            self.recv[id(t)] = recv
            self.held[id(t)] = held
            big = min(len(t.consumers), len(recv))
            sends: dict[int, Any] = {}
            if recv:
                count = sum(recv.values())
                for a in range(self.lo[pr], self.hi[pr] + 1):
                    if any(s > a for s in recv):
                        var = m.new_int_var(0, big, f"send_{pr}_{a}")
                        m.add(var >= count - big * (1 - self.on(pr, a)))
                        sends[a] = var
            self.w[id(t)] = sends

    def _memory(self) -> list[Any]:
        """Per rank (per stage with one stage per rank): its memory (Note [stage cost])."""
        p, m, S = self.p, self.m, self.p.num_stages
        users: dict[int, list[int]] = {}
        for u, ps in enumerate(p.unit_params):
            for q in ps:
                users.setdefault(q, []).append(u)
        out = []
        for r in range(p.num_ranks):
            mine = [s for s in range(S) if p.stage_ranks[s] == r]
            self._tick()
            expr: Any = 0
            for q, us in users.items():
                here = [(u, s) for s in mine for u in us if self.lo[u] <= s <= self.hi[u]]
                if here:
                    var = m.new_bool_var(f"param_{q}_{r}")
                    for u, s in here:
                        m.add(var >= self.on(u, s))
                    expr += (
                        int(round(p.state_factor * p.param_bytes[q])) * var
                    )  # sharding: a fraction
            for s in mine:
                expr += self._stage_buffers(s)
            out.append(expr)
        return out

    def _stage_buffers(self, s: int) -> Any:
        """Buffers, activations and boundary buffers of stage ``s``."""
        p = self.p
        k, kept = p.in_flight(s), p.activations_held(s)
        expr = sum(
            (p.buffer_bytes[u] + kept * p.activation_bytes[u]) * self.on(u, s)
            for u in range(p.num_units)
            if self.lo[u] <= s <= self.hi[u]
        )
        held = p.grads_held(s)
        for t in p.tensors:  # received x in flight, its gradient sent back x held, sent x M
            if s in self.recv[id(t)]:
                expr += (k + (held if t.requires_grad else 0)) * t.nbytes * self.recv[id(t)][s]
            if s in self.w[id(t)]:
                expr += p.microbatches * t.nbytes * self.w[id(t)][s]
        return expr

    def hint(self, assignment: Sequence[int]) -> None:
        """Tell CP-SAT where the given assignment puts every variable."""
        for u, row in enumerate(self.ge):
            for s, var in enumerate(row):
                if not isinstance(var, int):
                    self.m.add_hint(var, int(assignment[u] >= s))
        ranks = self.p.stage_ranks
        for t in self.p.tensors:
            a = assignment[t.producer]
            dests = {assignment[c] for c in t.consumers} - {a}
            for s, var in self.held[id(t)].items():
                self.m.add_hint(var, int(s in dests))
            remote = {d for d in dests if ranks[d] != ranks[a]}
            for s, var in self.recv[id(t)].items():
                self.m.add_hint(var, int(s in remote))
            for s, var in self.w[id(t)].items():
                self.m.add_hint(var, len(remote) if s == a else 0)

    def assignment(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(
            sum(int(solver.value(v)) if not isinstance(v, int) else v for v in row[1:-1])
            for row in self.ge
        )


def _solver(time_limit: float, workers: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = 0
    solver.parameters.find_clauses_that_are_exactly_one = False  # Note [CP-SAT time budget]
    return solver


def _kept_hint(
    problem: PartitionProblem, hint: Sequence[int] | None, time_limit: float, start: float, why: str
) -> Solution:
    if hint is None:
        raise PartitionError(
            f"CP-SAT found no assignment within {time_limit:.3g} s ({why}); raise the time limit "
            "or use solver='dp'"
        )
    return Solution(
        assignment=tuple(hint),
        solver="cpsat",
        seconds=time.perf_counter() - start,
        status=f"{why} within {time_limit:.3g} s; kept the hint",
    )


def solve_dag_cpsat(
    problem: PartitionProblem,
    *,
    hint: Sequence[int] | None = None,
    time_limit: float = 10.0,
    workers: int = 2,
    optimize: str = "speed",
    slack: float = 0.01,
    lower_bound_ms: float = 0.0,
) -> Solution:
    """Minimise the bottleneck over every order-respecting assignment (Note [CP-SAT encoding]).

    Honours pins and ``problem.memory_limit``; ``hint`` (e.g. the DP's answer) warm-starts
    the search. With ``optimize="memory"`` a second solve minimises peak stage memory
    among assignments within ``1 + slack`` of the best bottleneck found. ``time_limit``
    bounds the whole call (Note [CP-SAT time budget]). Raises ``InfeasibleError`` when
    CP-SAT proves no assignment fits, ``PartitionError`` when it finds none in
    ``time_limit`` seconds and no hint was given.
    """
    start = time.perf_counter()
    deadline = start + time_limit
    with_memory = problem.memory_limit is not None or optimize == "memory"
    try:
        model = _Model(problem, with_memory, deadline)
    except _OutOfTime:
        return _kept_hint(problem, hint, time_limit, start, "the CP-SAT model was not built")
    m = model.m
    horizon = sum(
        math.floor((f + b) / min(problem.speeds) * SCALE)
        for f, b in zip(problem.fwd_ms, problem.bwd_ms)
    )
    horizon += 2 * sum(model.msg) * problem.num_stages + 1
    T = m.new_int_var(max(0, math.floor(lower_bound_ms * SCALE)), horizon, "bottleneck")
    for expr in model.time:
        m.add(expr <= T)
    if problem.memory_limit is not None:
        for expr in model.memory:
            m.add(expr <= problem.memory_limit)
    if hint is not None:
        model.hint(hint)
        hint_ms = evaluate(problem, hint).bottleneck_ms
        m.add_hint(T, min(horizon, math.floor(hint_ms * SCALE)))
    m.minimize(T)
    left = deadline - time.perf_counter()
    if left <= 0:
        return _kept_hint(problem, hint, time_limit, start, "no time was left to solve")
    solver = _solver(left if optimize == "speed" else left / 2, workers)
    status = solver.solve(m)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(
            f"CP-SAT proved that no assignment to {problem.num_stages} stages satisfies the pins and the "
            f"memory limit of {problem.memory_limit} bytes; raise the limit, add stages or drop pins"
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _kept_hint(problem, hint, time_limit, start, "no solution")
    optimal = status == cp_model.OPTIMAL
    bound = solver.best_objective_bound / SCALE
    assignment = model.assignment(solver)
    note = "proven optimal" if optimal else f"time limit reached; bound {bound:.4g} ms"
    if optimize == "memory" and deadline - time.perf_counter() > 0.05:
        best = int(solver.value(T))
        m.add(T <= math.floor(best * (1 + slack)))
        peak = m.new_int_var(0, problem.memory_limit or 1 << 60, "peak_memory")
        for expr in model.memory:
            m.add(expr <= peak)
        m.clear_hints()
        model.hint(assignment)
        m.minimize(peak)
        second = _solver(deadline - time.perf_counter(), workers)
        if second.solve(m) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            assignment = model.assignment(second)
            note += f"; then least peak memory within {slack:.0%} of that bottleneck"
    return Solution(
        assignment=assignment,
        solver="cpsat",
        optimal=optimal,
        bound_ms=bound,
        seconds=time.perf_counter() - start,
        status=note,
    )
