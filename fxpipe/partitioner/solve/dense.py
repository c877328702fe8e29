"""The chain DP in its O(S n^2) form, for memory limits with shared (tied) parameters.

With tied parameters the memory of a stage ``[i, k)`` is not a difference ``a[k] -
b[i]`` (a shared weight counts once however many of its users the stage holds), so
the O(n log n) test in ``dp.py`` does not apply. Here every (start, end) pair gets
its memory (distinct parameters, buffers, activations x in flight, received inputs x
in flight, sent outputs x M, input gradients x (M - in flight + 1); Note [stage cost]; exact on a chain,
an upper bound on a branching graph, see ``cut_bytes``) as an n x n matrix, and the
min-max recurrence ``f_j[k] = min_i max(f_{j-1}[i], cost_j(i, k))`` runs once,
vectorised over i. It is also the oracle the tests hold the fast DP to.
"""

from __future__ import annotations

import numpy as np

from fxpipe.partitioner.problem import PartitionProblem

__all__ = ["DENSE_MAX_UNITS", "cut_bytes", "dense_split", "range_memory"]

DENSE_MAX_UNITS = 2000  # n^2 matrices of float64: 32 MB each at this size; dp.py warns above it


def cut_bytes(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boundary bytes at each position (0 at both ends): ``recv[c]`` the tensors live across
    c, ``recv_grad[c]`` those of them that require grad (their gradient is sent back), and
    ``send[c]`` the live tensors weighted by how many of their consumers lie at or after c.

    A stage starting at i receives at most ``recv[i]``, sends back at most
    ``recv_grad[i]`` of gradients, and one ending at k sends at most ``send[k]`` (one
    message per consuming stage, Note [stage cost]); on a chain all three are exact, on
    a branching graph they bound the true buffers from above.
    """
    n = problem.num_units
    recv = np.zeros(n + 2)
    recv_grad = np.zeros(n + 2)
    send = np.zeros(n + 2)
    for t in problem.tensors:
        recv[t.producer + 1] += t.nbytes
        recv[max(t.consumers) + 1] -= t.nbytes
        if t.requires_grad:
            recv_grad[t.producer + 1] += t.nbytes
            recv_grad[max(t.consumers) + 1] -= t.nbytes
        for c in t.consumers:
            send[t.producer + 1] += t.nbytes
            send[c + 1] -= t.nbytes
    out = tuple(np.cumsum(a)[: n + 1] for a in (recv, recv_grad, send))
    for a in out:
        a[0] = a[n] = 0.0
    return out[0], out[1], out[2]


def _distinct_params(problem: PartitionProblem) -> np.ndarray:
    """``D[i, k]``: bytes of the distinct parameters used by units in ``[i, k)``.

    A use of parameter q by unit u counts for start i iff the previous use of q lies
    before i, so ``D[i, k] = sum_{u in [i, k)} V[i, u]`` with V built by range adds.
    """
    n = problem.num_units
    V = np.zeros((n + 1, n))
    last: dict[int, int] = {}
    for u, ps in enumerate(problem.unit_params):
        for q in ps:
            prev = last.get(q, -1)
            V[prev + 1, u] += problem.param_bytes[q]
            V[u + 1, u] -= problem.param_bytes[q]
            last[q] = u
    V = np.cumsum(V, axis=0)[: n + 1]
    D = np.zeros((n + 1, n + 1))
    D[:, 1:] = np.cumsum(V, axis=1)  # V[i, u] == 0 for u < i, so this sums u in [i, k)
    return D


def range_memory(problem: PartitionProblem, stage: int) -> np.ndarray:
    """``M[i, k]``: memory of stage ``stage`` if it held units ``[i, k)`` (valid for i < k);
    exact on a chain, an upper bound on a branching graph (``cut_bytes``)."""
    k_in = problem.in_flight(stage)
    start, end = problem.cut_factors(stage)
    own = np.asarray(problem.buffer_bytes, float) + problem.activations_held(stage) * np.asarray(
        problem.activation_bytes, float
    )
    w = np.concatenate(([0.0], np.cumsum(own)))
    recv, recv_grad, send = cut_bytes(problem)
    mem = problem.state_factor * _distinct_params(problem) + (w[None, :] - w[:, None])
    held = problem.grads_held(stage)
    return (
        mem
        + start * (k_in * recv + held * recv_grad)[:, None]
        + end * problem.microbatches * send[None, :]
    )


def dense_split(
    problem: PartitionProblem,
    prefix: np.ndarray,
    cut: np.ndarray,
    pin_ok: list[np.ndarray],
    limit: float | None,
) -> tuple[float, tuple[int, ...]] | None:
    """Least DP bottleneck of a contiguous split with every stage's memory within ``limit``."""
    n, S = problem.num_units, problem.num_stages
    speeds = problem.speeds
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # i < k
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    choice = []
    mems: dict[tuple[int, int, float, float], np.ndarray] = {}
    for j in range(S):
        key = (problem.in_flight(j), problem.activations_held(j), *problem.cut_factors(j))
        if limit is not None and key not in mems:
            mems[key] = range_memory(problem, j) <= limit
        a_j, b_j = problem.cut_factors(j)
        cost = (
            (prefix[None, :] - prefix[:, None]) / speeds[j]
            + a_j * cut[:, None]
            + b_j * cut[None, :]
        )
        ok = upper if limit is None else upper & mems[key]
        cand = np.where(ok, np.maximum(f[:, None], cost), np.inf)
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(n + 1)]
        f = np.where(pin_ok[j], f, np.inf)
        choice.append(arg)
    if not np.isfinite(f[n]):
        return None
    assignment = [0] * n
    k = n
    for j in reversed(range(S)):
        i = int(choice[j][k])
        assignment[i:k] = [j] * (k - i)
        k = i
    assert k == 0, "dense DP backtrack did not reach the first unit"
    return float(f[n]), tuple(assignment)
